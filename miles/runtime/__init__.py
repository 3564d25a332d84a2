"""miles.runtime: the RL loop and its executors."""
