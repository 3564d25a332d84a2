"""Error types a user can act on.

Every mistake in a user's input (a flag, a file, a checkpoint) raises a subclass of
`MilesError`, which is a `ValueError`, with a message that names the thing that is wrong and
says what would be right. `assert` is kept for internal invariants only.
"""


class MilesError(ValueError):
    """A problem in the user's input: the message names the flag or file and the fix."""


class CheckpointError(MilesError):
    """A model checkpoint (directory, config.json, safetensors, GGUF) cannot be used."""


class ConfigError(MilesError):
    """A run or model configuration is invalid or contradictory."""
