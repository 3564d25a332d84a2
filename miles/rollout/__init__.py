"""miles.rollout: the generation engine (continuous batching, logprobs, routing capture) and server."""

from miles.rollout.engine import Engine, Request
from miles.rollout.sampling import SamplingParams

__all__ = ["Engine", "Request", "SamplingParams"]
