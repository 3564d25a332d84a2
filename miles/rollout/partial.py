"""Partial rollout (--partial-rollout): stop a rollout once enough groups are finished, and carry
the unfinished responses over to the next rollout instead of waiting for a few long tails.

Each rollout draws enough new prompts to keep --over-sampling-batch-size groups in flight
(carried ones included) and stops the engine as soon as --rollout-batch-size groups are complete.
A response cut off there keeps its tokens, log-probs and routing, and continues in the next rollout
under the new weights: its prompt is everything it has so far. The pieces are joined, and each
response token records the weight version that produced it (`Sample.token_versions`). The older
part is off-policy; --use-tis corrects it, and --mask-offpolicy-in-partial-rollout instead leaves
it out of the loss. Complete groups beyond what a step trains are carried whole, so every sample is
trained exactly once. On Ray engines the driver advances the engines in lock-step and stops them
all at a step boundary (`RolloutManager.generate_until`), so the cut does not depend on timing. Checkpoints keep the carried groups, so a resumed run
continues them as the uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from miles.config.schema import RunConfig
from miles.data.prompts import PromptItem
from miles.data.sample import Sample, Status
from miles.rewards.runner import RewardRunner
from miles.rollout.groups import group_requests, score_and_filter
from miles.rollout.sampling import Request, SamplingParams


@dataclass(eq=False)
class _Group:
    samples: list[Sample | None]  # finished, partial (ABORTED) or None (not started)
    requests: list[Request] = field(default_factory=list)  # a new group's, until they are sent
    index: int = 0  # fully-async: the order it was admitted in (trained oldest first)
    version: int = 0  # fully-async: the engine's weight version when it was admitted

    @property
    def complete(self) -> bool:
        return all(s is not None and s.status != Status.ABORTED for s in self.samples)


def join(old: Sample, more: Sample, mask_old: bool) -> Sample:
    """`old` (cut off) followed by `more`, which continued it from old.tokens."""
    old.tokens = list(more.tokens)
    old_len = old.response_length
    old.response_length = old_len + more.response_length
    old.rollout_log_probs = list(old.rollout_log_probs or []) + list(more.rollout_log_probs or [])
    old.loss_mask = [0 if mask_old else 1] * old_len + [1] * more.response_length
    old.token_versions = list(old.token_versions) + list(more.token_versions)
    old.weight_versions = list(old.weight_versions) + [
        v for v in more.weight_versions if not old.weight_versions or v != old.weight_versions[-1]
    ]
    old.rollout_routed_experts = more.rollout_routed_experts  # every position, from the last pass
    old.response = (old.response or "") + (more.response or "")
    old.status = more.status
    if old_len:  # a request aborted before its first token was not really cut off
        old.metadata["partial_resumes"] = old.metadata.get("partial_resumes", 0) + 1
    return old


CONTINUE = -1  # marks a continuation's seed apart from the group's first requests (ints only)


def continuation_seed(seed: int, rollout_id: int, g: int, k: int) -> int:
    """The sampling seed of sample k of group g continued in `rollout_id`. Only ints are hashed:
    a string's hash changes with every process (PYTHONHASHSEED), which made continued samples
    differ between two runs of the same command and after a resume."""
    return hash((seed, rollout_id, g, k, CONTINUE)) % (2**63)


class PartialRollout:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.carried: list[_Group] = []

    def _generate(self, engine, take, groups: list[_Group], done: list[_Group], rollout_id: int) -> None:
        """Top the groups up with new prompts, run new and carried requests until enough groups
        are complete (appended to `done`), and leave every sample in its group: finished or cut off."""
        cfg, rollout_cfg = self.cfg, self.cfg.rollout
        n, want = rollout_cfg.n_samples_per_prompt, rollout_cfg.rollout_batch_size
        in_flight = max(rollout_cfg.over_sampling_batch_size or want, want)
        for i, item in enumerate(take(max(0, in_flight - len(groups)))):
            temperature, seed = rollout_cfg.rollout_temperature, rollout_cfg.rollout_seed
            requests = group_requests(engine, item, cfg, rollout_id, i, n, temperature, seed)
            groups.append(_Group([None] * n, requests))
        before = len(done)
        done += advance(engine, groups, cfg, rollout_id, lambda completed: before + len(completed) >= want)

    def state_dict(self) -> dict:
        """The groups carried to the next rollout (every request sent: samples finished or cut off)."""
        assert all(not g.requests for g in self.carried), "carried groups hold sent requests only"
        return {"carried": [list(g.samples) for g in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.carried = [_Group(list(samples)) for samples in state["carried"]]

    def collect(
        self,
        engine,
        take: Callable[[int], list[PromptItem]],
        rewards: RewardRunner,
        rollout_id: int,
        keep_group: Callable | None,
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        cfg, want = self.cfg, self.cfg.rollout.rollout_batch_size
        groups = list(self.carried)
        carried_samples = sum(s is not None and s.status == Status.ABORTED for g in groups for s in g.samples)
        done = [g for g in groups if g.complete]  # carried whole from the last rollout: trained first
        if len(done) < want:  # else this step trains carried groups only and the engine rests
            self._generate(engine, take, groups, done, rollout_id)
        train_groups = done[:want]
        self.carried = [g for g in groups if g not in train_groups]
        batch = [list(g.samples) for g in train_groups]
        out, metrics = score_and_filter(batch, cfg, rewards, rollout_id, keep_group)
        metrics["partial_carried_samples"] = sum(
            s is not None and s.status == Status.ABORTED for g in self.carried for s in g.samples
        )
        metrics["partial_resumed_samples"] = carried_samples
        metrics["partial_groups_carried"] = len(self.carried)
        return out, metrics


def advance(
    engine, groups: list[_Group], cfg: RunConfig, rollout_id: int, stop: Callable[[list[_Group]], bool]
) -> list[_Group]:
    """Send the groups' new requests and continue their cut-off samples until `stop(the groups
    completed so far, in completion order)` holds; cut off the rest there (each sample stays in its
    group, finished or cut off). Returns the groups this call completed, in completion order."""
    requests, slot = [], []  # slot[i]: (group, sample index) of request i, named in its sample's metadata
    for g, group in enumerate(groups):
        todo = list(enumerate(group.requests)) or _continuations(cfg, group, rollout_id, g)
        for k, r in todo:
            if r.sample is None:
                r.sample = Sample()
            r.sample.metadata["partial_slot"] = len(slot)  # survives a trip to a Ray engine and back
            slot.append((group, k))
            requests.append(r)
        group.requests = []
    mask_old = cfg.rollout.mask_offpolicy_in_partial_rollout
    placed: list[Sample] = []
    completed: list[_Group] = []

    def place(sample: Sample) -> _Group:
        group, k = slot[sample.metadata.pop("partial_slot")]
        before = group.samples[k]
        if before is not None and before.status == Status.ABORTED:
            # continued: join the pieces; cut off again before a new token: keep what it had
            sample = join(before, sample, mask_old) if sample.response_length else before
        group.samples[k] = sample
        return group

    def enough(finished: list[Sample]) -> bool:
        for sample in finished[len(placed) :]:
            placed.append(sample)
            group = place(sample)
            if group.complete and group not in completed:
                completed.append(group)
        return stop(completed)

    if requests:
        finished, aborted = engine.generate_until(requests, enough)
        enough(finished)
        for sample in aborted:
            place(sample)
    return completed


def _continuations(cfg: RunConfig, group: _Group, rollout_id: int, g: int) -> list[tuple[int, Request]]:
    """(sample index, request) continuing each cut-off sample of a carried group from its tokens."""
    rollout_cfg = cfg.rollout
    requests = []
    for k, s in enumerate(group.samples):
        if s is None or s.status != Status.ABORTED:
            continue
        params = SamplingParams(
            temperature=rollout_cfg.rollout_temperature, top_p=rollout_cfg.rollout_top_p,
            top_k=rollout_cfg.rollout_top_k,
            max_new_tokens=rollout_cfg.rollout_max_response_len - s.response_length,
            seed=continuation_seed(rollout_cfg.rollout_seed, rollout_id, g, k),
        )  # fmt: skip
        requests.append((k, Request(list(s.tokens), params, images=s.multimodal_train_inputs)))
    return requests
