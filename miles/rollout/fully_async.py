"""Fully-async rollout (--rollout-mode fully-async): the engines keep generating while the trainer
trains, paced by admission control instead of discarding stale work.

The rollout runs in segments, one per training step, on a thread beside the trainer: segment
s+1 generates while step s trains, with the weights of version s. A segment admits new prompts
until --over-sampling-batch-size groups (default --rollout-batch-size, B) are generating, and
never beyond (s + N) x B admitted in all (N: --max-staleness), and ends, between two decoding steps, once B finished groups wait for training
and every group due at step s is finished. Each version's weights land there: responses still
generating are cut, keep their tokens, and continue in the next segment under the new weights
(`Sample.token_versions` records which version made each token, as partial rollout does). A group
admitted under version v is due at step v + N, and step s trains every finished group due by s,
then the oldest finished ones, B groups in all: no sample is trained more than N versions after
the weights that began it, none is discarded, and a long response holds its segment open instead
of being overtaken forever. Where segments end depends on the engines' progress, never on timing,
so a run is reproducible and resumes exactly.

--drop-stale keeps the peers' older rule for comparison: no deadlines, and finished groups staler
than N are discarded at training time (which starves long responses).
"""

from __future__ import annotations

from collections.abc import Callable

from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem
from miles.data.sample import Sample
from miles.rollout.groups import group_requests
from miles.rollout.partial import _Group, advance


class FullyAsyncRollout:
    """The admitted groups (in flight or finished, not yet trained), run segment by segment."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.bound = cfg.sync.max_staleness
        self.batch = cfg.rollout.rollout_batch_size
        # groups kept generating: one batch, or --over-sampling-batch-size to keep slots busy past long tails
        self.in_flight = max(cfg.rollout.over_sampling_batch_size or self.batch, self.batch)
        self.groups: list[_Group] = []  # admission order
        self.admitted = 0  # groups admitted since the run began
        self.dropped = 0  # --drop-stale: groups discarded since the run began
        self.segment = 0  # the next segment to run
        self.generated: list[int] = []  # response lengths finished since the last batch was taken

    def due(self, group: _Group) -> int:
        """The step by which `group` must be trained to stay within --max-staleness."""
        return group.version + self.bound

    def run_segment(self, engine, take: Callable[[int], list[PromptItem]]) -> None:
        """Admit what the bound allows, then generate until the next batch is ready; every
        response still generating is cut there, between two decoding steps."""
        cfg, rollout_cfg, s = self.cfg, self.cfg.rollout, self.segment
        self.segment = s + 1
        if self.ready(s):  # the batch waits already: the engines rest, and nothing new is admitted
            return
        version, n = engine.weight_version, rollout_cfg.n_samples_per_prompt
        bound_room = (s + self.bound) * self.batch + self.dropped - self.admitted
        unfinished = sum(not g.complete for g in self.groups)
        for item in take(max(0, min(bound_room, self.in_flight - unfinished))):
            requests = group_requests(
                engine,
                item,
                cfg,
                s,
                self.admitted,
                n,
                rollout_cfg.rollout_temperature,
                rollout_cfg.rollout_seed,
            )
            self.groups.append(_Group([None] * n, requests, index=self.admitted, version=version))
            self.admitted += 1
        for group in advance(engine, self.groups, cfg, s, lambda _: self.ready(s)):
            self.generated += [x.response_length for x in group.samples]

    def ready(self, step: int) -> bool:
        """Whether step `step`'s batch can be taken: B finished groups, and every group due by then finished."""
        finished = sum(g.complete for g in self.groups)
        if self.cfg.sync.drop_stale:
            return finished >= self.batch
        return finished >= self.batch and all(g.complete for g in self.groups if self.due(g) <= step)

    def take_batch(self, step: int, world: int = 1) -> tuple[list[list[Sample]], dict[str, float]]:
        """Step `step`'s groups (every finished one due by then, then the oldest finished) and the
        pacing metrics: staleness of what is in flight and queued, what was generated meanwhile.
        `world` training ranks: groups not yet due wait for the next step until the samples split
        evenly over the ranks (nothing is dropped for the split)."""
        finished = [g for g in self.groups if g.complete]
        dropped = 0
        if self.cfg.sync.drop_stale:
            stale = [g for g in finished if max(staleness(x, step) for x in g.samples) > self.bound]
            dropped, self.dropped = len(stale), self.dropped + len(stale)
            finished = [g for g in finished if g not in stale]
            self.groups = [g for g in self.groups if g not in stale]
        due = [g for g in finished if self.due(g) <= step]
        rest = [g for g in finished if self.due(g) > step]
        batch = sorted(due + rest[: max(0, self.batch - len(due))], key=lambda g: g.index)
        while sum(len(g.samples) for g in batch) % world and any(self.due(g) > step for g in batch):
            batch.remove(max((g for g in batch if self.due(g) > step), key=lambda g: g.index))
        self.groups = [g for g in self.groups if g not in batch]
        in_flight = [g for g in self.groups if not g.complete]
        queued = [g for g in self.groups if g.complete]
        metrics = {
            "staleness_in_flight": max((step - g.version for g in in_flight), default=0),
            "staleness_in_queue": max((step - g.version for g in queued), default=0),
            "groups_in_flight": len(in_flight),
            "groups_in_queue": len(queued),
            "stale_dropped": dropped,
            "response_len_generated_mean": sum(self.generated) / max(1, len(self.generated)),
        }
        self.generated = []
        return [list(g.samples) for g in batch], metrics

    def state_dict(self) -> dict:
        """Everything admitted and not yet trained (responses cut at the segment's end keep their
        tokens), and the counters that pace admission."""
        assert all(not g.requests for g in self.groups), "a segment ends with every request sent"
        return {
            "groups": [(list(g.samples), g.index, g.version) for g in self.groups],
            "admitted": self.admitted,
            "dropped": self.dropped,
            "segment": self.segment,
            "generated": list(self.generated),
        }

    def start_at(self, step: int) -> None:
        """Begin at `step` with nothing admitted (a checkpoint of another mode): as if every group
        before it had been admitted and trained."""
        self.groups, self.segment, self.admitted, self.dropped = [], step, step * self.batch, 0

    def load_state_dict(self, state: dict) -> None:
        self.groups = [_Group(list(samples), index=i, version=v) for samples, i, v in state["groups"]]
        self.admitted, self.dropped = state["admitted"], state["dropped"]
        self.segment, self.generated = state["segment"], list(state["generated"])


def staleness(sample: Sample, version: int) -> int:
    """How many versions `sample` lags `version`: from the oldest weights that produced part of it."""
    return version - min(sample.weight_versions or [version])


def trained_staleness(groups: list[list[Sample]], step: int) -> list[int]:
    """Each trained sample's staleness at `step`."""
    return [staleness(s, step) for g in groups for s in g]
