"""miles.rollout: the generation engine (continuous batching, logprobs, routing capture).

`Engine` is imported on first use, so what needs only `Request` or `SamplingParams` (the
protocols, clients of remote engines) does not load the engine and its decode steps."""

from miles.rollout.sampling import Request, SamplingParams

__all__ = ["Engine", "Request", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from miles.rollout.engine import Engine

        return Engine
    raise AttributeError(f"module 'miles.rollout' has no attribute {name!r}")
