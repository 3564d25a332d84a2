"""Built-in tool calling: generate, parse calls, run the tools, append their results, go on.

Every conversation still running at a turn is generated in one call of the rollout (any
`Rollout`: the in-process engine, Ray engines, SGLang servers), and all their tool calls run in
parallel in the sandboxed workers. The response budget (`max_new_tokens` of the request,
--rollout-max-response-len) covers the whole conversation after the prompt: the policy's turns
and the tool results. A conversation ends when a turn calls no tool (finish `stop`, or
`turn_length` for a turn cut at --max-turn-tokens), the budget is spent (`length`), the turn limit is reached
with a call pending (`max_turns`) or the tool results would not fit the budget (`context`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.agents.chat import bridge, encode, prompt_ids, render
from miles.agents.tool_calls import CallError, ToolCall
from miles.agents.tools import ToolBox
from miles.data.sample import Sample, Status
from miles.data.trajectory import Trajectory
from miles.rollout.sampling import Request


@dataclass
class ToolCalling:
    """The `--tool-path` rollout mode."""

    box: ToolBox
    parser: Callable[[str], list]
    stop: list[str]  # stop strings that end a turn at a finished call
    max_turns: int = 4
    max_tool_calls: int = 8
    max_turn_tokens: int | None = None  # tokens one turn may generate (None: what is left of the budget)
    max_seq_len: int | None = None  # the engines' context: prompt + everything after it (set by the run)

    def prompt_overhead(self, tokenizer) -> int:
        """Characters the tools add to a prompt (a bound on their tokens)."""
        bare = [{"role": "user", "content": "."}]
        with_tools = render(tokenizer, bare, self.box.schemas, generation_prompt=True)
        return len(with_tools) - len(render(tokenizer, bare, None, generation_prompt=True)) + 16

    def prompt_ids(self, tokenizer, prompt, chat: bool) -> list[int]:
        return prompt_ids(tokenizer, prompt, self.box.schemas)

    def generate_each(self, rollout, requests: Sequence[Request]) -> list[list[Sample]]:
        return [[s] for s in self.generate(rollout, requests)]

    def close(self) -> None:
        self.box.close()

    def generate(self, rollout, requests: Sequence[Request]) -> list[Sample]:
        tokenizer = rollout.tokenizer
        trajectories = [Trajectory.start(r.prompt_ids) for r in requests]
        live = list(range(len(requests)))
        for turn in range(self.max_turns):
            if not live:
                break
            turn_requests = [self._request(requests[i], trajectories[i], turn) for i in live]
            outs = rollout.generate(turn_requests)
            pending: dict[int, list[ToolCall | CallError]] = {}
            for i, out in zip(live, outs):
                t = trajectories[i]
                t.add_turn(out, tokenizer.decode(out.response_tokens, skip_special_tokens=True))
                if out.status is Status.ABORTED or t.response_length >= requests[i].params.max_new_tokens:
                    t.end(out.status, "length" if out.status is Status.TRUNCATED else out.status.value)
                    continue
                calls = self._parse(tokenizer.decode(out.response_tokens, skip_special_tokens=False))
                if not calls:  # the answer (or a turn cut at --max-turn-tokens)
                    t.end(out.status, "stop" if out.status is Status.COMPLETED else "turn_length")
                elif turn == self.max_turns - 1:
                    t.end(Status.TRUNCATED, "max_turns")
                else:
                    pending[i] = self._capped(calls, t)
            live = self._observe(pending, trajectories, requests, tokenizer)
        return [
            t.fill(r.sample if r.sample is not None else Sample()) for t, r in zip(trajectories, requests)
        ]

    def _parse(self, text: str) -> list:
        try:
            return list(self.parser(text))
        except Exception as e:  # noqa: BLE001 - a parser that cannot read this turn: the policy is told
            return [CallError("parser_error", f"the tool call could not be read ({type(e).__name__}: {e})")]

    def _request(self, request: Request, t: Trajectory, turn: int) -> Request:
        p = request.params
        params = dataclasses.replace(
            p,
            max_new_tokens=min(
                p.max_new_tokens - t.response_length, self.max_turn_tokens or p.max_new_tokens
            ),
            stop=[*p.stop, *(s for s in self.stop if s not in p.stop)],
            seed=p.seed if turn == 0 or p.seed is None else hash((p.seed, turn)) % 2**63,
        )
        return Request(list(t.tokens), params)

    def _capped(self, calls: list, t: Trajectory) -> list:
        room = max(0, self.max_tool_calls - t.tool_calls)
        over = [CallError("too_many_calls", f"over the limit of {self.max_tool_calls} tool calls")] * (
            len(calls) - room
        )
        return calls[:room] + over

    def _observe(self, pending, trajectories, requests, tokenizer) -> list[int]:
        """Run every pending call; append each conversation's results; return those that go on."""
        flat = [(i, c) for i, calls in pending.items() for c in calls]
        results = self.box.run([c for _, c in flat])
        by_conversation: dict[int, list] = {i: [] for i in pending}
        for (i, c), r in zip(flat, results):
            by_conversation[i].append((c, r))
        live = []
        for i, done in by_conversation.items():
            t = trajectories[i]
            t.tool_calls += sum(isinstance(c, ToolCall) for c, _ in done)
            for c, r in done:
                t.tool_seconds += r.seconds
                if r.error:
                    t.tool_errors[r.error] += 1
                call = {"name": c.name, "arguments": c.arguments} if isinstance(c, ToolCall) else {}
                t.calls.append({**call, "result": r.text, "error": r.error})
            messages = [
                {"role": "tool", "name": c.name if isinstance(c, ToolCall) else "error", "content": r.text}
                for c, r in done
            ]
            last = t.tokens[-1]
            special = last in set(tokenizer.all_special_ids)  # an EOS the policy generated
            tail = tokenizer.decode([last], skip_special_tokens=False) if special else ""
            text = bridge(tokenizer, [{"role": "user", "content": "."}], messages, self.box.schemas, tail)
            ids = encode(tokenizer, text)
            over_context = self.max_seq_len is not None and len(t.tokens) + len(ids) >= self.max_seq_len
            if over_context or t.response_length + len(ids) >= requests[i].params.max_new_tokens:
                t.end(Status.TRUNCATED, "context")
                continue
            t.add_observation(ids)
            live.append(i)
        return live
