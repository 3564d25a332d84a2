"""Speculative decoding: a cheap draft proposes k tokens, the policy checks them in one pass.

Exact speculative sampling: with q the draft's distribution and p the policy's (both after
temperature, top-k and top-p), a proposed token x is accepted with probability min(1, p(x)/q(x));
at the first rejection the token is drawn from norm(max(0, p - q)) instead, and when all k are
accepted a bonus token is drawn from p. The tokens then follow p exactly, whatever the draft, and
the log-probs recorded for RL come from the policy's own verify pass. A draft only changes how
many tokens one policy pass yields: (1 - a^(k+1)) / (1 - a) on average for acceptance a.

Drafts: `ModelDraft` (a smaller causal LM with its own KV cache, e.g. the policy's first layers)
and `NgramDraft` (continues the longest recent match of the context's suffix; nearly free).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles.rollout.sampling import allowed_logits, draw, scale_by_temperature


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The distribution a token is sampled from: softmax of the temperature-scaled logits over the
    top-k/top-p set; one-hot at the argmax for greedy rows. logits (B, T, V), params (B,)."""
    B, T, V = logits.shape
    scaled, greedy = scale_by_temperature(logits, temperature)
    flat = scaled.reshape(B * T, V)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        flat = allowed_logits(flat, top_k.repeat_interleave(T), top_p.repeat_interleave(T))
    probs = flat.softmax(-1).reshape(B, T, V)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None, None], onehot, probs)
    return probs


def verify_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, logp) for a verify pass's logits (B, T, V): p as `sampling_probs`, logp the log-softmax
    of the temperature-scaled logits that plain decoding records. One softmax serves both when no
    row is greedy or filtered (an RL rollout's usual case)."""
    scaled, greedy = scale_by_temperature(logits, temperature)
    logp = scaled.log_softmax(-1)
    if bool(greedy.any()) or bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        return sampling_probs(logits, temperature, top_k, top_p), logp
    return logp.exp(), logp


def accept(
    proposed: Sequence[Sequence[int]],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> list[tuple[int, int]]:
    """For each row: (how many of its proposals are accepted, the token that follows them) by exact
    speculative sampling, row b with generator b. q (B, k, V): the draft's distributions the
    proposals were drawn from; p (B, k + 1, V): the policy's at the same positions and one more.
    A certain proposal (q None: one-hot at x, as an n-gram draft makes) needs no q: max(0, p - q)
    is p with x's mass removed. The following tokens are drawn together, one CDF pass."""
    B, width = len(proposed), max((len(row) for row in proposed), default=0)
    ids = torch.zeros(B, max(width, 1), dtype=torch.long)
    for b, row in enumerate(proposed):
        ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    px = p[:, :width].gather(-1, ids[:, :width, None])[..., 0].tolist()
    qx = None if q is None else q[:, :width].gather(-1, ids[:, :width, None])[..., 0].tolist()
    counts = []
    for b, row in enumerate(proposed):
        n = len(row)
        for i in range(len(row)):
            qi = 1.0 if qx is None else qx[b][i]
            if not (qi > 0 and float(torch.rand((), generator=generators[b])) * qi < px[b][i]):
                n = i
                break
        counts.append(n)
    rows, at = torch.arange(B), torch.tensor(counts, dtype=torch.long)
    following = p[rows, at]  # all accepted: the bonus token from p
    rejected = at < torch.tensor([len(row) for row in proposed], dtype=torch.long)
    if bool(rejected.any()):
        kept = at.clamp(max=max(width - 1, 0))
        if q is None:
            residual = following.clone()
            residual[rows, ids[rows, kept]] = 0.0
        else:
            residual = (following - q[rows, kept]).clamp(min=0)
        empty = residual.sum(-1) <= 0  # p == q up to rounding: draw from p
        residual[empty] = following[empty]
        following = torch.where(rejected[:, None], residual, following)
    return list(zip(counts, draw(following, generators).tolist()))


@dataclass
class SpecStats:
    """Counts since the last `take`: what each step's metrics report."""

    k: int
    proposed: int = 0
    accepted: int = 0
    passes: int = 0  # verify passes of the policy (one per speculative step)
    rows: int = 0  # request-steps verified (one per running request per pass)
    emitted: int = 0  # tokens those request-steps produced (accepted + one each)
    at_position: list[int] = field(default_factory=list)  # accepted proposals by draft position
    offered: list[int] = field(
        default_factory=list
    )  # proposals checked at each position (all before it accepted)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_steps: int = 0  # decoding steps that ran without speculation (batch above the limit)

    def __post_init__(self) -> None:
        self.at_position = [0] * self.k
        self.offered = [0] * self.k

    def record(self, n_proposed: int, n_accepted: int) -> None:
        self.proposed += n_proposed
        self.accepted += n_accepted
        self.rows += 1
        self.emitted += n_accepted + 1
        for i in range(min(n_accepted + 1, n_proposed)):  # positions this row reached
            self.offered[i] += 1
            self.at_position[i] += int(i < n_accepted)

    @staticmethod
    def merge(parts: Sequence[SpecStats]) -> SpecStats | None:
        """Several engines' counts as one (None when no engine speculates)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        out = SpecStats(max(p.k for p in parts))
        for p in parts:
            for name in ("proposed", "accepted", "passes", "rows", "emitted", "plain_steps"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            out.draft_seconds = max(out.draft_seconds, p.draft_seconds)  # engines run side by side
            out.verify_seconds = max(out.verify_seconds, p.verify_seconds)
            for i in range(p.k):
                out.at_position[i] += p.at_position[i]
                out.offered[i] += p.offered[i]
        return out

    def metrics(self) -> dict[str, float]:
        if not self.rows:
            return {"spec_plain_steps": float(self.plain_steps)} if self.plain_steps else {}
        out = {
            # per checked proposal: the a of (1 - a^(k+1)) / (1 - a), next to the whole-proposal share
            "spec_accept_rate": self.accepted / max(sum(self.offered), 1),
            "spec_accepted_share": self.accepted / max(self.proposed, 1),
            "spec_accepted_len_mean": self.accepted / self.rows,
            "spec_tokens_per_pass": self.emitted / self.rows,
            "spec_draft_seconds": self.draft_seconds,
            "spec_verify_seconds": self.verify_seconds,
            "spec_plain_steps": float(self.plain_steps),
        }
        for i, (a, o) in enumerate(zip(self.at_position, self.offered)):
            if o:
                out[f"spec_accept_pos{i + 1}"] = a / o
        return out


def expected_tokens_per_pass(a: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): tokens one verify pass yields with per-token acceptance a."""
    return tokens_per_pass_by_position([a] * k)


def tokens_per_pass_by_position(acceptance: list[float]) -> float:
    """Expected tokens one verification yields when position j is accepted with probability
    acceptance[j] given the ones before it: 1 + a1 + a1 a2 + ..."""
    total, reached = 1.0, 1.0
    for a in acceptance:
        reached *= a
        total += reached
    return total


def best_lookahead(a: float, draft_seconds_per_token: float, verify_seconds: float, k_max: int = 8) -> int:
    """The lookahead that maximises expected tokens per second, for a measured acceptance and costs."""
    rate = {
        k: expected_tokens_per_pass(a, k) / (verify_seconds + k * draft_seconds_per_token)
        for k in range(1, k_max + 1)
    }
    return max(rate, key=rate.get)


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self.start = now - self.start, now
        return elapsed


def lookahead_arms(k: int) -> list[int]:
    """The lookaheads adaptive speculation measures: 0 (a plain step), 1, 2, 3 and k."""
    return sorted({0, *range(1, min(k, 3) + 1), k})


class Speculator:
    """What an engine needs to decode speculatively: the draft, the lookahead k, the batch size above
    which speculation is off, and the counts behind the spec_* metrics.

    `adaptive`: below that cap, the engine decodes each step with the lookahead of
    `lookahead_arms(k)` (0 being a plain step) that gives the most tokens per second at the
    current batch size: expected tokens per row per pass, from the draft's acceptance at each
    position (counted over every pass, whatever the batch), over the seconds a pass of that
    lookahead takes at that batch size (measured). A verification's cost grows with the tokens it
    checks (on a CPU from a few rows on), so the best lookahead shrinks as the batch grows, and
    acceptance moves as the draft trains. Costs are measured per batch size, not per range of
    them: a pass of 8 rows costs more than one of 5, and comparing lookaheads measured at
    different sizes would favour the one measured at the cheaper size. A pass's time varies
    little and its tokens a lot (1 to k + 1 per row), so rating a lookahead by its expected
    tokens rather than the tokens it happened to make needs far fewer steps. Each lookahead is
    first timed `warmup` steps at a batch size; every `explore`-th step there re-times one of the
    others, in turn; `decay` weighs recent passes more. Every way of decoding samples exactly
    from the policy, so the choice changes speed only.
    """

    def __init__(
        self,
        draft,
        lookahead: int = 5,
        max_batch: int = 16,
        adaptive: bool = False,
        explore: int = 16,
        warmup: int = 2,
        decay: float = 0.95,
    ) -> None:
        self.draft, self.k, self.max_batch = draft, lookahead, max_batch
        self.adaptive, self.explore, self.warmup, self.decay = adaptive, explore, warmup, decay
        self.arms = lookahead_arms(lookahead)
        self.stats = SpecStats(lookahead)
        self.cost: dict[tuple[int, int], list[float]] = {}  # (batch, lookahead) -> [passes, seconds, count]
        self.offered = [0.0] * lookahead  # proposals checked at each position (decayed counts)
        self.accepted = [0.0] * lookahead  # and accepted
        self.turns: dict[int, int] = {}  # decisions made per batch size

    def acceptance(self, lookahead: int) -> list[float]:
        """The draft's measured acceptance at positions 1..lookahead (a position never checked
        yet: the one before it)."""
        out, last = [], 0.0
        for hits, offered in zip(self.accepted[:lookahead], self.offered[:lookahead]):
            last = hits / offered if offered > 0 else last
            out.append(last)
        return out

    def rate(self, batch: int, lookahead: int) -> float:
        """Expected tokens per second per row at this batch size and lookahead (0: untimed)."""
        passes, seconds, _ = self.cost.get((batch, lookahead), (0.0, 0.0, 0))
        if seconds <= 0:
            return 0.0
        tokens = tokens_per_pass_by_position(self.acceptance(lookahead)) if lookahead else 1.0
        return tokens * passes / seconds

    def choose(self, batch: int) -> int:
        """The lookahead for this decoding step of `batch` running requests; 0: a plain step."""
        if batch > self.max_batch:
            return 0
        if not self.adaptive:
            return self.k
        turn = self.turns[batch] = self.turns.get(batch, 0) + 1
        untimed = [k for k in reversed(self.arms) if self.cost.get((batch, k), (0, 0, 0))[2] < self.warmup]
        if untimed:  # time each first, the longest lookahead first
            return untimed[0]
        best = max(self.arms, key=lambda k: self.rate(batch, k))
        if turn % self.explore:
            return best
        others = [k for k in self.arms if k != best]
        return others[(turn // self.explore) % len(others)]

    def record(self, batch: int, lookahead: int, seconds: float) -> None:
        """A step of `batch` requests at `lookahead` (0: plain) took `seconds`. After a
        verification the acceptance counts decay too: recent passes weigh more, as the draft
        trains."""
        m = self.cost.setdefault((batch, lookahead), [0.0, 0.0, 0])
        m[0], m[1], m[2] = self.decay * m[0] + 1, self.decay * m[1] + seconds, m[2] + 1
        if lookahead:
            self.offered = [self.decay * n for n in self.offered]
            self.accepted = [self.decay * n for n in self.accepted]

    def observe(self, proposed: int, accepted: int) -> None:
        """One row of a verification: `accepted` of its `proposed` tokens kept."""
        for i in range(min(accepted + 1, proposed, self.k)):
            self.offered[i] += 1
            self.accepted[i] += i < accepted
        self.stats.record(proposed, accepted)

    def take_stats(self) -> SpecStats:
        """The counts since the last call."""
        out, self.stats = self.stats, SpecStats(self.k)
        return out
