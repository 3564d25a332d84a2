"""Proposer and solver (Absolute Zero's pair) on reasoning-gym's arithmetic.

The proposer writes a problem; the solver answers it `attempts` times; reasoning-gym's scorer
for `basic_arithmetic` grades each answer against the problem's true value. Rewards:

- solver: the scorer's grade of each attempt (1.0 for the bare right number, partial credit for
  a right number inside other text);
- proposer: 1 - (solver pass rate) when the pass rate is strictly between 0 and 1 (a problem the
  solver solves sometimes: it can learn from it), 0 for one it always or never solves, less
  `repeat_penalty` x the share of the step's other proposals that are the same problem (so a
  proposer cannot settle on a few problems the solver has learned), and -1 for a response with
  no problem in it.

The proposer's prompt shows a reference problem, as Absolute Zero's does: drawn from the last
`references` problems that were learnable (seeded with the task's own 1-2 digit problems), so
the references follow the solver's band. A problem is the first `a + b` or `a - b` (numbers of
at most `max_digits` digits) in the proposer's response; the solver sees it as the task's own
question ("Calculate a + b.").
The solver's attempts at one problem form a group (`metadata["group"]`): each is measured
against the group's mean, as GRPO does. Held-out accuracy is measured on the default job's
problems (`basic_arithmetic`, 1-2 digits), greedy, every `eval_interval` steps.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

from miles.data.sample import Sample
from miles.models.tokenizer import encode_prompt
from miles.multiagent.episodes import seeded
from miles.rollout import Engine, Request, SamplingParams

PROPOSER_PROMPT = "Propose a problem like {reference}."
PROBLEM = re.compile(r"(\d+)\s*([+-])\s*(\d+)")


def parse_problem(text: str, max_digits: int = 3) -> tuple[str, int] | None:
    """The first `a op b` in `text` as (expression, value), or None."""
    m = PROBLEM.search(text)
    if m is None or len(m.group(1)) > max_digits or len(m.group(3)) > max_digits:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return f"{a} {op} {b}", a + b if op == "+" else a - b


def proposer_reward(valid: bool, pass_rate: float, repeat_share: float = 0.0) -> float:
    """1 - pass rate inside (0, 1) (the learnable band), else 0, less `repeat_share` (the share of
    the step's other proposals that are the same problem); -1 without a problem."""
    if not valid:
        return -1.0
    return (1.0 - pass_rate if 0.0 < pass_rate < 1.0 else 0.0) - repeat_share


class ProposerSolver:
    """The multi-agent environment; it plays its own episodes (`play`), since a proposer's
    reward needs several independent attempts of the solver."""

    agents = ("proposer", "solver")
    max_new_tokens = 16
    max_seq_len = 192  # byte tokens: the chat-templated prompt (~80) and a response

    def __init__(self, seed: int = 0, attempts: int = 4, max_digits: int = 3, eval_size: int = 200,
                 eval_interval: int = 10, references: int = 64, repeat_penalty: float = 1.0) -> None:  # fmt: skip
        from miles.data.prompts import default_job_task_config, task_prompts

        self.attempts, self.max_digits, self.eval_interval = attempts, max_digits, eval_interval
        self.repeat_penalty = repeat_penalty
        self.requests_per_episode = 1 + attempts
        self.rng = random.Random(seed)
        self.eval_items, self.scorer = task_prompts(
            "basic_arithmetic", eval_size, seed + 10007, default_job_task_config()
        )
        seeds, _ = task_prompts("basic_arithmetic", references, seed, default_job_task_config())
        self.references = deque(
            (item.metadata["rg_entry"]["metadata"]["expression"] for item in seeds), maxlen=references
        )

    def grade(self, response: str, value: int) -> float:
        return float(self.scorer.score_answer(response.strip(), {"answer": str(value)}))

    def play(
        self,
        engines: Mapping[str, Engine],
        tokenizer,
        n: int,
        params: SamplingParams,
        seed: int | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, list[Sample]]]:
        """`n` problems, `attempts` answers to each valid one; states and each agent's samples
        (`seed`: as in `miles.multiagent.episodes.play`)."""
        params = dataclasses.replace(params, ignore_eos=False, max_new_tokens=self.max_new_tokens)
        references = [self.rng.choice(self.references) for _ in range(n)]
        prompts = [
            encode_prompt(tokenizer, PROPOSER_PROMPT.format(reference=r), chat=True) for r in references
        ]
        proposals = engines["proposer"].generate(
            [Request(p, seeded(params, seed, 0, i)) for i, p in enumerate(prompts)]
        )
        states = []
        for p, reference in zip(proposals, references):
            problem = parse_problem(
                tokenizer.decode(p.response_tokens, skip_special_tokens=True), self.max_digits
            )
            states.append({"problem": problem, "grades": [], "reference": reference})
        valid = [i for i, s in enumerate(states) if s["problem"] is not None]
        requests = [
            Request(
                encode_prompt(tokenizer, f"Calculate {states[i]['problem'][0]}.", chat=True),
                seeded(params, seed, 1, i, k),
            )
            for i in valid
            for k in range(self.attempts)
        ]
        answers = engines["solver"].generate(requests) if requests else []
        solver: list[Sample] = []
        for k, answer in enumerate(answers):
            i = valid[k // self.attempts]
            text = tokenizer.decode(answer.response_tokens, skip_special_tokens=True)
            grade = self.grade(text, states[i]["problem"][1])
            states[i]["grades"].append(grade)
            solver.append(_own(answer, grade, "solver", group=i))
        proposer = []
        counts = Counter(s["problem"][0] for s in states if s["problem"] is not None)
        for p, state in zip(proposals, states):
            problem = state["problem"]
            state["pass_rate"] = sum(g == 1.0 for g in state["grades"]) / self.attempts
            repeats = counts[problem[0]] - 1 if problem is not None else 0
            reward = proposer_reward(
                problem is not None, state["pass_rate"], self.repeat_penalty * repeats / n
            )
            proposer.append(_own(p, reward, "proposer"))
            if reward > 0:  # learnable: a reference for later proposals
                self.references.append(problem[0])
        return states, {"proposer": proposer, "solver": solver}

    def episode_metrics(self, states: list[dict[str, Any]]) -> dict[str, float]:
        """Of the proposed problems: the valid share, the learnable share (solved sometimes, not
        always), the solver's pass rate, and the mean number of digits of the operands."""
        valid = [s for s in states if s["problem"] is not None]
        if not valid:
            return {"valid_share": 0.0, "learnable_share": 0.0}
        digits = [len(str(abs(int(x)))) for s in valid for x in re.findall(r"\d+", s["problem"][0])]
        return {
            "valid_share": len(valid) / len(states),
            "learnable_share": sum(0 < s["pass_rate"] < 1 for s in valid) / len(states),
            "solver_pass_rate": sum(s["pass_rate"] for s in valid) / len(valid),
            "problem_digits": sum(digits) / len(digits),
            "distinct_share": len({s["problem"][0] for s in valid}) / len(valid),
        }

    def tracker(self) -> SolverEval:
        return SolverEval(self.eval_interval)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "references": list(self.references)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.references = deque(state["references"], maxlen=self.references.maxlen)


class SolverEval:
    """Every `eval_interval` calls (and the first), the solver's greedy accuracy on held-out
    problems (`solver_eval_accuracy`: full marks only, as the default job counts)."""

    def __init__(self, eval_interval: int) -> None:
        self.eval_interval, self.calls = eval_interval, 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]

    def __call__(self, env: ProposerSolver, models, tokenizer, rollouts) -> dict[str, float]:
        self.calls += 1
        if (self.calls - 1) % self.eval_interval:
            return {}
        params = SamplingParams(temperature=0.0, max_new_tokens=env.max_new_tokens)
        requests = [
            Request(encode_prompt(tokenizer, item.prompt, chat=True), params) for item in env.eval_items
        ]
        outs = rollouts["solver"].generate(requests)
        right = [
            float(env.scorer.score_answer(tokenizer.decode(o.response_tokens, skip_special_tokens=True).strip(),
                                               item.metadata["rg_entry"]) == 1.0)
            for o, item in zip(outs, env.eval_items)
        ]  # fmt: skip
        return {"solver_eval_accuracy": sum(right) / len(right)}


def _own(sample: Sample, reward: float, agent: str, group: int | None = None) -> Sample:
    """An engine's sample as its agent's training sample: every response token its own."""
    sample.reward = reward
    sample.loss_mask = [1] * sample.response_length
    sample.metadata = {**sample.metadata, "agent": agent, **({"group": group} if group is not None else {})}
    return sample
