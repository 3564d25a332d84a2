"""--auto-batch --memory-budget-gb G: the largest token budget per micro-batch that fits G.

No peer sizes its own micro-batches; users find --max-tokens-per-gpu by trial and error. Here
the trainer measures each micro-batch's peak memory (host RSS on CPU, allocated CUDA memory on a
GPU) and time against its padded tokens, fits peak = base + slope x tokens, and takes the budget
where the line meets G less a margin. It starts from the longest sample alone and grows at most
2x per micro-batch beyond the largest size measured, so it never leaps past what it has seen;
every new measurement refits the line, so longer responses later in a run are seen as they
come. Growth also stops where it stops paying: it goes on only while each doubling is at least
5% faster per token than every smaller size measured (a CPU's caches favour mid-sized
micro-batches, and a slow first step must not pass for a fast large one); otherwise the budget
goes back to the fastest size measured that fits.
Gradient accumulation is exact for any split, so changing the budget between micro-batches
changes nothing but memory and speed. Once a whole step has run without changing the budget it
is settled: measurements then skip the heap trim (which makes every micro-batch fault its
memory in again), reading the peak over what the allocator keeps, an overestimate.
"""

from __future__ import annotations

import logging

log = logging.getLogger("miles")

MARGIN = 0.1  # keep this share of the budget free: allocator slack, a longer batch than measured
GROWTH = 2.0  # at most this many times the largest measured micro-batch
GAIN = 1.05  # growing on needs the largest size to beat every smaller one's tokens/s by this factor


class AutoBatch:
    def __init__(self, budget_bytes: float, floor_tokens: int) -> None:
        """`floor_tokens`: the longest sample (a micro-batch never holds less)."""
        self.limit = budget_bytes * (1 - MARGIN)
        self.floor = floor_tokens
        self.tokens = floor_tokens  # the budget in use
        self.points: list[tuple[int, int]] = []  # (padded tokens of a micro-batch, its peak bytes)
        self.rates: dict[int, list[float]] = {}  # size bucket (log2 tokens) -> tokens/s measured
        self.sizes: dict[int, int] = {}  # size bucket -> the largest tokens measured in it
        self.warned = False
        self.settled = False  # a whole step ran at one budget: measure without trimming the heap
        self._step_start: int | None = None

    def start_step(self) -> None:
        self._step_start = self.tokens

    def end_step(self) -> None:
        """A step ended: settled when its budget did not move."""
        self.settled = self._step_start == self.tokens

    def fit(self) -> tuple[float, float]:
        """(base bytes, bytes per token) by least squares; with one size measured, base 0 (an
        overestimate of the slope: the safe side)."""
        xs = [float(t) for t, _ in self.points]
        ys = [float(p) for _, p in self.points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread == 0:
            return 0.0, mean_y / mean_x
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
        return mean_y - slope * mean_x, slope

    def fastest(self) -> tuple[int, bool, bool]:
        """(the size whose mean tokens/s is highest, whether growing still pays: the largest size
        measured beats every smaller one by GAIN, whether that verdict rests on one timing only)."""
        means = {b: sum(r) / len(r) for b, r in self.rates.items()}
        best = max(means, key=means.get)
        largest = max(means)
        smaller = [m for b, m in means.items() if b != largest]
        pays = not smaller or means[largest] >= GAIN * max(smaller)
        return self.sizes[best], pays, len(self.rates[largest]) < 2

    def observe(self, tokens: int, peak: int, seconds: float | None = None) -> None:
        """One micro-batch of `tokens` padded tokens peaked at `peak` bytes (in `seconds`): choose
        the next budget."""
        self.points = (self.points + [(tokens, peak)])[-64:]
        if seconds:
            bucket = max(tokens, 1).bit_length()
            self.rates.setdefault(bucket, []).append(tokens / seconds)
            self.sizes[bucket] = max(self.sizes.get(bucket, 0), tokens)
        base, slope = self.fit()
        largest = max(t for t, _ in self.points)
        room = self.limit - base
        wanted = room / slope if slope > 0 else float("inf")
        growth = GROWTH * largest
        if self.rates:
            best, growing_pays, one_timing = self.fastest()
            if not growing_pays:  # one slow timing is measured again before the budget goes back
                growth = self.sizes[max(self.rates)] if one_timing else best
        chosen = max(self.floor, int(min(wanted, growth)))
        if base + slope * self.floor > self.limit and not self.warned:
            log.warning(
                "--auto-batch: even one longest sample (%d tokens) is predicted to peak at %.2f GB, over the "
                "--memory-budget-gb budget less its margin (%.2f GB); micro-batches stay at one sample",
                self.floor, (base + slope * self.floor) / 1e9, self.limit / 1e9,
            )  # fmt: skip
            self.warned = True
        if chosen != self.tokens:
            log.debug(
                "--auto-batch: %d -> %d tokens per micro-batch (measured %.3f GB at %d tokens; fit %.3f GB + %.3g "
                "MB/token)", self.tokens, chosen, peak / 1e9, tokens, base / 1e9, slope / 1e6,
            )  # fmt: skip
        self.tokens = chosen
