"""How a rollout turns requests into samples: one engine call per sample (the default), or a
multi-turn mode (`miles.agents`). `rollout_mode(cfg)` picks the run's; `generate_groups` asks it
for each request's samples (a black-box agent that forks yields one per branch)."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from miles.agents.lockstep import EngineClient, Lockstep
from miles.config.schema import RunConfig
from miles.data.sample import Sample, Status
from miles.data.trajectory import AGENT_ERROR
from miles.errors import MilesError
from miles.models.tokenizer import encode_prompt
from miles.rewards.functions import load_function
from miles.rollout.sampling import Request

log = logging.getLogger("miles")


class RolloutMode(Protocol):
    max_seq_len: int | None  # the engines' context, set by the run (multi-turn conversations stop before it)

    def prompt_overhead(self, tokenizer) -> int | None: ...  # characters added to each prompt (None: unknown)

    def prompt_ids(self, tokenizer, prompt, chat: bool) -> list[int]: ...

    def generate_each(self, rollout, requests: Sequence[Request]) -> list[list[Sample]]: ...

    def close(self) -> None: ...


class SingleTurn:
    """One engine call per sample."""

    max_seq_len: int | None = None

    def prompt_overhead(self, tokenizer) -> int | None:
        return 0

    def prompt_ids(self, tokenizer, prompt, chat: bool) -> list[int]:
        return encode_prompt(tokenizer, prompt, chat)

    def generate_each(self, rollout, requests):
        return [[s] for s in rollout.generate(requests)]

    def close(self) -> None:
        pass


def failed(request: Request, error: BaseException, flag: str, reported: list) -> Sample:
    """A sample whose generation raised: no response, its group is dropped; the first error is logged."""
    sample = copy.copy(request.sample) if request.sample is not None else Sample()
    sample.tokens, sample.response_length = list(request.prompt_ids), 0
    sample.loss_mask, sample.rollout_log_probs, sample.status = [], [], Status.FAILED
    sample.metadata = {
        **sample.metadata,
        "finish": AGENT_ERROR,
        "agent_error": f"{type(error).__name__}: {error}",
    }
    if not reported:
        reported.append(error)
        log.error(
            "%s raised for a sample (its group is dropped; further errors are counted in agent_errors):\n%s",
            flag,
            getattr(error, "__miles_traceback__", repr(error)).rstrip(),
        )
    return sample


class CustomGenerate(SingleTurn):
    """`--custom-generate-function-path`: fn(sample, client, params) -> Sample, one thread per sample."""

    FLAG = "--custom-generate-function-path"

    def prompt_overhead(self, tokenizer) -> int | None:
        return None  # the function writes its own prompts

    def __init__(self, path: str, processor=None) -> None:
        """`processor`: a vision-language run's (`client.process` for images in later turns)."""
        self.fn = load_function(path, self.FLAG)
        self.reported: list = []
        self.processor = processor

    def generate_each(self, rollout, requests):
        def job(request: Request, client: EngineClient) -> Sample:
            sample = copy.deepcopy(request.sample) if request.sample is not None else Sample()
            sample.tokens, sample.response_length = list(request.prompt_ids), 0
            sample.multimodal_train_inputs = request.images  # the prompt's own images
            out = self.fn(sample, client, request.params)
            return checked(out, self.FLAG)

        lockstep = Lockstep(rollout)
        jobs = [functools.partial(job, r) for r in requests]
        results = lockstep.run(jobs, rollout.tokenizer, self.processor)
        out = [[self._result(r, res)] for r, res in zip(requests, results)]
        for (sample,), seen in zip(out, lockstep.images_seen or []):
            if seen:  # a turn sent fewer images than an earlier one: the model no longer saw them
                sample.metadata["image_turns_dropped"] = sum(
                    b < max(seen[:i]) for i, b in enumerate(seen) if i
                )
        return out

    def _result(self, request: Request, out: Any) -> Sample:
        if isinstance(out, ContractError):
            raise out  # a function that returns the wrong thing fails the same way every time: stop
        if isinstance(out, BaseException):
            return failed(request, out, self.FLAG, self.reported)
        return out


class ContractError(MilesError):
    pass


def checked(sample: Any, flag: str) -> Sample:
    """A returned sample the trainer can use, or a ContractError saying what is wrong."""
    if not isinstance(sample, Sample):
        raise ContractError(f"{flag} must return a miles Sample, got {type(sample).__name__}")
    n = sample.response_length
    problems = []
    if not 0 < n < len(sample.tokens):
        problems.append(
            f"response_length {n} must be in (0, {len(sample.tokens)}) (tokens = prompt + response)"
        )
    for name in ("loss_mask", "rollout_log_probs"):
        value = getattr(sample, name)
        if value is None or len(value) != n:
            problems.append(
                f"{name} must hold one value per response token ({n}), got {None if value is None else len(value)}"
            )
    if problems:
        raise ContractError(f"{flag} returned a sample the trainer cannot use: {'; '.join(problems)}")
    if sample.status is Status.PENDING:
        sample.status = Status.COMPLETED
    return sample


class BlackBoxAgent(SingleTurn):
    """`--agent-path`: fn(base_url, sample) runs the user's agent against an OpenAI-compatible URL."""

    FLAG = "--agent-path"

    def prompt_overhead(self, tokenizer) -> int | None:
        return None  # the agent writes its own prompts

    def __init__(self, path: str, max_tokens: int) -> None:
        self.fn: Callable = load_function(path, self.FLAG, "module:function(base_url, sample)")
        self.max_tokens = max_tokens
        self.gateway = None
        self.reported: list = []

    def generate_each(self, rollout, requests):
        from miles.agents.gateway import AgentGateway
        from miles.agents.openai_api import trajectory

        if self.gateway is None:
            self.gateway = AgentGateway(rollout.tokenizer, self.max_tokens)
        sessions: list[str] = [""] * len(requests)

        def job(i: int, client: EngineClient) -> Any:
            sid, url = self.gateway.open(client, requests[i].params)
            sessions[i] = sid
            return self.fn(url, copy.deepcopy(requests[i].sample or Sample()))

        results = Lockstep(rollout).run(
            [functools.partial(job, i) for i in range(len(requests))], rollout.tokenizer
        )
        out = []
        for request, sid, result in zip(requests, sessions, results):
            session = self.gateway.take(sid) if sid else None
            ends = session.branch_ends() if session is not None else []
            if isinstance(result, BaseException) or not ends:
                error = (
                    result
                    if isinstance(result, BaseException)
                    else MilesError("the agent asked for no completion")
                )
                out.append([failed(request, error, self.FLAG, self.reported)])
                continue
            samples = []
            for branch, end in enumerate(ends):
                sample = trajectory(end).fill(copy.deepcopy(request.sample) if request.sample else Sample())
                sample.metadata["branch"] = branch
                if isinstance(result, str):
                    sample.response = result  # the agent's final answer is what the reward scores
                elif isinstance(result, (int, float)) and not isinstance(result, bool):
                    sample.metadata["agent_reward"] = float(result)
                samples.append(sample)
            out.append(samples)
        return out

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()


def rollout_mode(cfg: RunConfig) -> RolloutMode:
    """The run's rollout mode, its tools and functions imported now (a bad path fails before any work)."""
    agent = cfg.agent
    if agent.tool_path:
        from miles.agents.tool_calls import load_parser
        from miles.agents.tool_rollout import ToolCalling
        from miles.agents.tools import ToolBox, load_tools
        from miles.rewards.workers import Limits

        parser, stop = load_parser(agent.tool_call_parser)
        limits = Limits(agent.tool_cpu_seconds, agent.tool_memory_mb, agent.tool_file_mb)
        box = ToolBox(load_tools(agent.tool_path), agent.tool_timeout, limits, agent.tool_num_workers)
        return ToolCalling(box, parser, stop, agent.max_turns, agent.max_tool_calls, agent.max_turn_tokens)
    if agent.custom_generate_function_path:
        from miles.data.images import vision_processor

        processor = vision_processor(cfg.model.model, cfg.sglang.rollout_backend == "sglang")
        return CustomGenerate(agent.custom_generate_function_path, processor)
    if agent.agent_path:
        return BlackBoxAgent(agent.agent_path, cfg.rollout.rollout_max_response_len)
    return SingleTurn()
