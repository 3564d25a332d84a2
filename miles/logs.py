"""The `miles` logger's console output, set once per command from --log-level / MILES_DEBUG.

miles logs to its own logger with its own handler, so the level holds whatever a library
(Ray, transformers) did to the root logger first, and DEBUG shows miles' lines, not theirs.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s miles %(levelname)s %(message)s"


def setup_logging(level: str = "INFO") -> logging.Logger:
    logger = logging.getLogger("miles")
    for handler in [h for h in logger.handlers if getattr(h, "miles_console", False)]:
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.miles_console = True
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger
