"""The `miles` logger's console output, set once per command from --log-level / MILES_DEBUG.

miles logs to its own logger with its own handler and level, so the level holds whatever a
library (Ray, transformers) did to the root logger, and DEBUG shows miles' lines, not theirs.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s miles %(levelname)s %(message)s"


class _Stderr(logging.StreamHandler):
    """Writes to the current sys.stderr (which a test harness or a notebook may swap)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(level: str = "INFO") -> logging.Logger:
    logger = logging.getLogger("miles")
    for handler in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return logger
