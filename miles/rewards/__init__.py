"""miles.rewards: built-in rewards and loading a user's reward function by path."""

from miles.rewards.builtin import boxed_answer, exact_match
from miles.rewards.functions import load_function
from miles.rewards.runner import RewardRunner

__all__ = ["RewardRunner", "boxed_answer", "exact_match", "load_function"]
