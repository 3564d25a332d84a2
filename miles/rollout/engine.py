"""The rollout engine: continuous batching over a KV cache allocated once.

`add_request` queues work; each `step` first admits waiting requests into free cache slots
(one batched prefill), then decodes one token for every running request. A finished request
frees its slot at once, so a batch of mixed lengths never waits for its longest member.
`generate` runs steps until a list of requests is done. Weight updates requested from any thread
are applied between steps, never inside one.

The engine is the scheduler; the model's arithmetic is a `DecodeStep` (`miles.rollout.steps`:
the fused C++ step on CPU, the model's general forward elsewhere) and token choice is the
`Sampler` (`miles.rollout.sampling`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from miles.data.sample import Sample, Status
from miles.devices import weight_memory
from miles.errors import MilesError
from miles.models.transformer import Transformer
from miles.models.vision import prompt_vision
from miles.rollout.kv_budget import DEFAULT_FRACTION, plan_budget
from miles.rollout.sampling import Request, Sampler, Uniforms
from miles.rollout.speculative import SpecStats, Speculator, Timer, accept, verify_probs
from miles.rollout.steps import DecodeStep, choose_step
from miles.rollout.weights import apply_named_tensors, served_weights

log = logging.getLogger("miles")


class Scored(NamedTuple):
    """`Engine.score` of one sequence: each token's log-prob after the first, and with top-k the
    k likeliest tokens (ids, log-probs) at each of those positions."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass
class _Running:
    request: Request
    slot: int
    generator: torch.Generator
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed: list[np.ndarray] = field(default_factory=list)  # per fed chunk: (tokens, layers, k)
    versions: list[int] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    rope_offset: int = 0  # vision-language: rotary position - cache position after the prompt's images
    uniforms: Uniforms | None = None  # the generator's numbers a block at a time (no speculative decoding)
    features: list[torch.Tensor] = field(
        default_factory=list
    )  # EAGLE online training: one per response token

    @property
    def length(self) -> int:
        return len(self.request.prompt_ids) + len(self.response)


@dataclass
class EngineTimes:
    """Where the engine's time went: prefill forwards, and decode steps' forwards with the rows
    (tokens) they produced. benchmarks/rollout_throughput.py reads the decode-only throughput
    here to set against the per-step bound. Wall-clock on the host: exact on a CPU; on a GPU,
    kernels still running when a timer stops count towards whatever waits for them next."""

    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @classmethod
    def merge(cls, parts: list[EngineTimes | None]) -> EngineTimes | None:
        """The sum over engines (None when none reports)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        return cls(*(sum(getattr(p, f.name) for p in parts) for f in fields(cls)))

    def metrics(self) -> dict[str, float]:
        """The run's engine_* metrics (engine time since the previous record, evaluation included)."""
        return {
            "engine_prefill_time": self.prefill_seconds,
            "engine_decode_time": self.decode_seconds,
            "engine_decode_tokens": self.decode_tokens,
            "engine_decode_tokens_per_s": self.decode_tokens_per_second,
        }


# A finished request's KV-cache pages go back to the OS when it held more than this; a short
# one's stay for the slot's next request (handing pages back and taking them again costs more
# than a short request's whole decode), so an idle slot holds at most this much.
KEEP_SLOT_BYTES = 4 * 2**20


class Engine:
    """Batched generation with logprobs, routing capture and versioned weight updates."""

    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        seed: int = 0,
        admit_batch: int | None = None,
        speculator: Speculator | None = None,
        decode_step: str = "auto",
        eos_token_ids: Iterable[int] = (),
        mem_fraction_static: float = DEFAULT_FRACTION,
    ) -> None:
        """`decode_step`: auto | fused | general (`miles.rollout.steps.choose_step`);
        `mem_fraction_static`: the share of the memory free now that the KV cache may hold
        (`miles.rollout.kv_budget`: requests beyond it wait in the queue);
        `admit_batch`: while requests decode, admit waiting ones once this many slots are free;
        `eos_token_ids`: ends of text besides the model config's and the tokenizer's (an engine
        whose tokenizer stays with the caller: a Ray engine actor)."""
        self.model, self.tokenizer, self.speculator = model.eval(), tokenizer, speculator
        self.device = model.lm_head.weight.device  # inputs go there; sampling noise is drawn on CPU
        self.slots, self.seed, self.step_choice = max_batch_size, seed, decode_step
        context = model.config.max_position_embeddings  # never generate past what the model knows
        self.max_seq_len = min(max_seq_len or context, context)
        self.admit_batch = admit_batch if admit_batch is not None else max(1, max_batch_size // 8)
        self._build_step()
        self.draft = speculator.draft if speculator is not None else None
        if self.draft is not None:
            self.draft.attach(self.model)
        self.kv_budget = plan_budget(
            model.kv_bytes_per_token(), self.slots, self.max_seq_len, self.device, mem_fraction_static,
            whole=self.device.type != "cpu",
        )  # fmt: skip
        self.cache = model.new_cache(self.slots, self.max_seq_len)
        log.info(
            "KV cache: %d slots of %d tokens, %s; memory follows the tokens in flight%s",
            self.slots, self.max_seq_len, self.kv_budget.describe(),
            "" if self.cache.paged else " (allocated whole on this device)",
        )  # fmt: skip
        self._reserved = 0  # KV-cache tokens reserved by the requests running (each its worst case)
        self.sampler = Sampler(self.device)
        self.weight_version = 0
        self.restarts = 0  # an in-process engine is never restarted (the Ray manager's count)
        self.is_moe = model.config.is_moe
        self._eos = set(model.config.eos_token_ids) | set(eos_token_ids)
        # a vision-language policy that samples an image marker ends its response there: fed back,
        # the marker would stand for pixels no processor made (training never feeds a last token)
        cfg = model.config
        self._markers = {
            t
            for t in (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
            if t is not None
        }
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self._eos.add(tokenizer.eos_token_id)
        self._uids = itertools.count()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Running] = {}  # slot -> state
        self._init_locks()
        self._arrivals = 0  # requests added so far
        self._abort_before: int | None = None  # abort_all(): requests that arrived before this count
        self.times = EngineTimes()

    def _init_locks(self) -> None:
        self._lock = threading.Lock()  # guards the pending-update list
        self._step_lock = threading.RLock()  # held for a whole step: updates land between steps
        # an update holds this while it waits for the step lock, and each step passes through it
        # first: Python locks are not fair, so without it a decoding loop that takes the step lock
        # straight back could hold an update off until its whole batch finished
        self._turnstile = threading.RLock()
        self._pending_updates: list[tuple[list[tuple[str, torch.Tensor]], int | None, threading.Event]] = []
        self._defer_refill = self._needs_refill = False  # see paused()

    def _build_step(self) -> None:
        """(Re)choose the decode step for the model as it is now; `decode_path` says which and why."""
        self.decode_step: DecodeStep
        self.decode_step, self.decode_path = choose_step(self.model, self.step_choice)
        log.debug("rollout engine decode step: %s", self.decode_path)

    # ---- public API ----

    def add_request(self, request: Request) -> int:
        if not request.prompt_ids:
            raise MilesError("a request needs at least one prompt token")
        if len(request.prompt_ids) >= self.max_seq_len:
            raise MilesError(
                f"prompt of {len(request.prompt_ids)} tokens does not fit the engine's context of "
                f"{self.max_seq_len} (max_seq_len)"
            )
        vocab = self.model.model.embed_tokens.weight.shape[0]
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
            raise MilesError(f"prompt token ids must lie in [0, {vocab}) for this model; got {bad[:5]}")
        if request.params.stop and self.tokenizer is None:
            raise MilesError("stop strings need the engine to have a tokenizer")
        request.uid = next(self._uids) if request.uid < 0 else request.uid
        request.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self._waiting.append(request)
        return request.uid

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def generate(self, requests: Iterable[Request], progress: bool = False) -> list[Sample]:
        """Run `requests` to completion; samples come back in the order given."""
        requests = list(requests)
        if len({id(r) for r in requests}) != len(requests):
            raise MilesError("the same Request object appears twice; make one Request per sample")
        for r in requests:
            self.add_request(r)
        wanted = {r.uid: i for i, r in enumerate(requests)}
        out: list[Sample | None] = [None] * len(requests)
        remaining = len(requests)
        bar = tqdm(total=len(requests), desc="rollout", unit="sample", disable=not progress, leave=False)
        while remaining:
            if not self.has_work():
                raise RuntimeError("engine ran out of work with requests unfinished (aborted from outside?)")
            for sample in self.step():
                index = wanted.get(sample.metadata["request_id"])
                if index is not None:
                    out[index] = sample
                    remaining -= 1
                    bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    def generate_until(
        self, requests: Iterable[Request], enough: Callable[[list[Sample]], bool]
    ) -> tuple[list[Sample], list[Sample]]:
        """Run `requests` until `enough(finished so far)` holds, then abort the rest (partial
        rollout): (finished samples in the order they finished, aborted ones with their tokens,
        log-probs and routing so far)."""
        requests = list(requests)
        for r in requests:
            self.add_request(r)
        wanted = {r.uid for r in requests}
        finished: list[Sample] = []
        while self.has_work():
            finished += [s for s in self.step() if s.metadata["request_id"] in wanted]
            if self.has_work() and enough(finished):
                self.abort_all()
                return finished, [s for s in self.step() if s.metadata["request_id"] in wanted]
        return finished, []

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None, wait: bool = True
    ) -> None:
        """Load HF-named tensors into the engine's model between decoding steps.

        Called while another thread runs `step`, the update waits for the current step to end;
        requests in flight keep their tokens and continue with the new weights (their KV cache
        is recomputed), and each sample lists every version it was generated with.
        """
        done = threading.Event()
        with self._lock:
            self._pending_updates.append((list(named_tensors), version, done))
        if wait:
            with self._turnstile, self._step_lock:  # waits for the running step to end, not the batch
                self._apply_updates()
            done.wait()

    @contextmanager
    def paused(self):
        """Hold decoding across a weight update sent in several parts (buckets): no step runs
        between the parts, and in-flight requests' keys/values are recomputed once, at the end."""
        with self._turnstile, self._step_lock:
            self._defer_refill = True
            try:
                yield self
            finally:
                self._defer_refill = False
                if self._needs_refill and self._running:
                    self._refill(list(self._running.values()))
                self._needs_refill = False

    def flush_cache(self) -> bool:
        """Zero the KV cache when no request is in flight (SGLang's /flush_cache); False if busy."""
        with self._step_lock:
            if self.has_work():
                return False
            if self.cache is not None:
                self.cache.clear()
            return True

    def release_memory(self) -> int:
        """Free the KV cache while nothing is in flight, so a colocated trainer can use the
        memory; the next step allocates it again. Returns the bytes freed (0 if busy)."""
        with self._step_lock:
            if self.has_work() or self.cache is None:
                return 0
            freed, self.cache = self.cache.nbytes, None
            return freed

    def score(self, sequences: list[list[int]], temperature: float = 1.0, topk: int = 0) -> list[Scored]:
        """log softmax(logits / temperature) of each token after the first, given the ones before
        it, under the served weights, and with `topk` the k likeliest tokens at each of those
        positions: one full forward per sequence, between decoding steps (the prefill-only request
        a distillation teacher answers)."""
        from miles.algo.distill import topk_of
        from miles.algo.logprobs import token_logprobs

        out = []
        with self._step_lock, torch.no_grad():
            device = next(self.model.parameters()).device
            for seq in sequences:
                ids = torch.tensor([seq], dtype=torch.long, device=device)
                logits = self.model(ids).logits[0, :-1]
                top = topk_of(logits, topk, temperature) if topk else (None, None)
                out.append(Scored(token_logprobs(logits, ids[0, 1:], temperature).float().cpu(), *top))
        return out

    def states(self) -> list[dict[str, torch.Tensor]]:
        """This engine's weights (one engine) and any LoRA adapter it serves, as received, for
        --check-weight-update-equal and --check-lora-weight-equal."""
        return [served_weights(self.model)]

    def node_ids(self) -> list[str]:
        """Ray nodes of the engine processes: none, it runs in this one."""
        return []

    def update_draft(self, state: dict[str, torch.Tensor]) -> None:
        """New weights for the speculative draft (online training), applied between steps."""
        with self._turnstile, self._step_lock:
            draft = self.speculator.draft
            draft.model.load_state_dict(state)
            draft.invalidate()

    def take_times(self) -> EngineTimes:
        """Where the engine's time went since the last call (see EngineTimes)."""
        with self._step_lock:
            times, self.times = self.times, EngineTimes()
        return times

    def take_spec_stats(self) -> SpecStats | None:
        """The speculative-decoding counts since the last call (None without a draft)."""
        if self.speculator is None:
            return None
        with self._step_lock:
            return self.speculator.take_stats()

    def set_precision(self, mode: str) -> None:
        """bf16 (precision warm-up) or fp8 for the FP8 layers, between decoding steps."""
        from miles.quant.convert import set_mode

        with self._turnstile, self._step_lock:
            set_mode(self.model, mode)
            self._build_step()

    def peak_memory(self) -> list[dict[str, int]]:
        """Its weights by dtype; its peak RSS is the driver's (`mem_driver_*`): it shares the process."""
        return [weight_memory(self.model)]

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives and ends with this process."""

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def abort_all(self) -> None:
        """Finish every request waiting or running now as ABORTED at the next step (requests added
        later are not touched, even when that step comes after they arrive)."""
        self._abort_before = self._arrivals

    # ---- the step ----

    def step(self) -> list[Sample]:
        """Admit, prefill, decode one token for each running request; return finished samples."""
        with self._turnstile:
            pass  # an update waiting for the step lock goes first
        with self._step_lock:
            if self.cache is None:  # released by release_memory()
                self.cache = self.model.new_cache(self.slots, self.max_seq_len)
            self._apply_updates()
            if self._abort_before is not None:
                return self._abort_everything()
            finished = self._admit()
            if self._running:
                finished += self._decode()
            return finished

    def _apply_updates(self) -> None:
        with self._lock:
            updates, self._pending_updates = self._pending_updates, []
        if not updates:
            return
        for tensors, version, _ in updates:
            apply_named_tensors(self.model, tensors)
            self.weight_version = version if version is not None else self.weight_version + 1
        if not self.decode_step.intact():  # a parameter was replaced, not copied into
            self._build_step()
        if self._running:  # keys/values of running requests were computed by the old weights
            if self._defer_refill:
                self._needs_refill = True
            else:
                self._refill(list(self._running.values()))
        for *_, done in updates:
            done.set()

    def _reservation(self, request: Request) -> int:
        """The KV-cache tokens a request may come to hold: its prompt and every token it may add."""
        return min(len(request.prompt_ids) + request.params.max_new_tokens, self.max_seq_len)

    def _admit(self) -> list[Sample]:
        free = [s for s in range(self.slots) if s not in self._running]
        # A prefill is one extra forward: gather a few free slots before paying for it.
        if self._running and len(free) < min(self.admit_batch, len(self._waiting)):
            return []
        new = []
        while free and self._waiting:
            need = self._reservation(self._waiting[0])
            if self._reserved + need > self.kv_budget.tokens:  # it waits for memory to be handed back
                break
            self._reserved += need
            req = self._waiting.popleft()
            seed = req.params.seed if req.params.seed is not None else hash((self.seed, req.uid)) % (2**63)
            stop = (
                set(req.params.stop_token_ids)
                | (set() if req.params.ignore_eos else self._eos)
                | self._markers
            )
            state = _Running(req, free.pop(0), torch.Generator().manual_seed(seed), stop_ids=frozenset(stop))
            if self.speculator is None:  # nothing but `draw` reads the generator: read it ahead
                state.uniforms = Uniforms(state.generator, min(req.params.max_new_tokens, 64))
            self._running[state.slot] = state
            if self.draft is not None:
                self.draft.reset(state.slot)
            new.append(state)
        if not new:
            return []
        timer = Timer()
        logits, hidden = self._refill(new)
        self.times.prefill_seconds += timer.lap()
        return self._emit(new, logits, hidden)

    def _refill(self, states: list[_Running]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill each state's tokens except the newest into its slot; logits of its last fed token,
        and the hidden state they come from (which the draft sees, for the newest token).

        Identical sequences (the n samples of one GRPO prompt) are computed once and their keys
        and values copied into the other slots.
        """
        seqs = [
            tuple(s.request.prompt_ids + s.response[:-1]) if s.response else tuple(s.request.prompt_ids)
            for s in states
        ]
        # the same ids with other images are another sequence (a group's samples share one dict)
        keys = [(seq, id(s.request.images)) for seq, s in zip(seqs, states)]
        firsts: dict[tuple, int] = {}  # sequence -> the first state holding it
        for b, key in enumerate(keys):
            firsts.setdefault(key, b)
        unique = {key: u for u, key in enumerate(firsts)}  # sequence -> its prefill row
        owners = [states[firsts[key]] for key in unique]  # the state whose slot computes each sequence
        T = max(len(seq) for seq, _ in unique)
        ids = torch.zeros(len(unique), T, dtype=torch.long)
        for u, (x, _) in enumerate(unique):
            ids[u, : len(x)] = torch.tensor(x)
        rows = torch.tensor([s.slot for s in owners])
        lengths = torch.tensor([len(x) for x, _ in unique])
        dev = self.device
        vision = None
        if self.model.config.is_vision_language:
            vision = prompt_vision(ids, lengths, [s.request.images for s in owners], self.model.config)
        out = self.decode_step.prefill(ids, lengths, rows, self.cache, vision=vision)
        index = [unique[key] for key in keys]  # each state's prefill row
        if vision is not None:
            for b, s in enumerate(states):
                s.rope_offset = int(vision.deltas[index[b]])
        copied = [b for b in range(len(states)) if states[b] is not owners[index[b]]]
        if copied:  # one gather per buffer; positions past a copy's own length are masked later
            dst = torch.tensor([states[b].slot for b in copied], device=dev)
            src = torch.tensor([owners[index[b]].slot for b in copied], device=dev)
            for buf in self.cache.keys + self.cache.values:
                buf[dst, :, :T] = buf[src, :, :T]
        if self.is_moe:
            routed = out.routed_experts.to(torch.int32).cpu().numpy()
            for b, s in enumerate(states):
                s.routed = [routed[index[b], : len(seqs[b])]]
        rows = torch.tensor(index, device=dev)
        hidden = None if out.hidden is None else out.hidden[rows, 0]
        if self.draft is not None and hidden is not None:
            for s, feature in zip(states, hidden):
                self.draft.see(s.slot, feature)
        return out.logits[rows, 0], hidden

    def _decode(self) -> list[Sample]:
        spec = self.speculator
        if spec is None:
            return self._decode_plain()
        batch, timer = len(self._running), Timer()
        room = min(self.max_seq_len - s.length for s in self._running.values())
        lookahead = min(spec.choose(batch), room)
        speculative = lookahead >= 1
        before = sum(len(s.response) for s in self._running.values())
        if speculative:
            finished = self._decode_speculative(lookahead)
        else:
            spec.stats.plain_steps += 1
            finished = self._decode_plain()
        after = sum(len(s.response) for s in self._running.values()) + sum(
            s.response_length for s in finished
        )
        elapsed = timer.lap()
        if speculative:  # the whole step (draft, verify, acceptance): a plain step times its own forward
            self.times.decode_seconds += elapsed
            self.times.decode_steps += 1
            self.times.decode_tokens += after - before
        spec.record(batch, lookahead, elapsed)
        return finished

    def _decode_speculative(self, k: int) -> list[Sample]:
        """Up to k + 1 tokens for every running request from one pass of the policy: the draft
        proposes k, the policy scores them all at once, exact speculative sampling keeps a prefix
        and draws the token after it. Keys and values of rejected positions stay in the cache
        past the sequence's end, masked by position and overwritten later."""
        spec, timer = self.speculator, Timer()
        states = sorted(self._running.values(), key=lambda s: s.slot)
        temperature, top_k, top_p = self.sampler.params([s.request for s in states])
        seqs = [list(s.request.prompt_ids) + s.response for s in states]
        generators = [s.generator for s in states]
        proposed, q = self.draft.propose(
            [s.slot for s in states], seqs, k, temperature, top_k, top_p, generators
        )
        proposed = [list(map(int, row)) for row in proposed]
        spec.stats.draft_seconds += timer.lap()
        width = max(len(row) for row in proposed) + 1
        ids = torch.zeros(len(states), width, dtype=torch.long)
        positions = torch.zeros(len(states), width, dtype=torch.long)
        for b, (s, row) in enumerate(zip(states, proposed)):
            ids[b, : len(row) + 1] = torch.tensor([s.response[-1], *row])
            positions[b] = torch.arange(s.length - 1, s.length - 1 + width)
        out = self._forward_slots(ids, positions, states)
        logits = out.logits
        p, logp = (t.cpu() for t in verify_probs(logits, temperature, top_k, top_p))
        q = q.cpu() if q is not None else None
        routed = out.routed_experts.to(torch.int32).cpu().numpy() if self.is_moe else None
        hidden = out.hidden
        spec.stats.verify_seconds += timer.lap()
        spec.stats.passes += 1
        finished = []
        decided = accept(proposed, q, p, generators)  # q None: certain proposals (n-gram)
        for b, (s, row, (n, following)) in enumerate(zip(states, proposed, decided)):
            spec.observe(len(row), n)
            self.draft.keep(s.slot, s.length + min(n, len(row) - 1))
            if routed is not None:  # the policy's routing of every fed token that was kept
                s.routed.append(routed[b, : n + 1])
            for i, token in enumerate(row[:n] + [following]):
                feature = None if hidden is None else hidden[b, i]
                sample = self._append(s, token, float(logp[b, i, token]), feature)
                if sample is not None:
                    finished.append(sample)
                    break
        return finished

    def _decode_plain(self) -> list[Sample]:
        """One token for every running request, each over its own cache slot."""
        states = sorted(self._running.values(), key=lambda s: s.slot)
        ids = torch.tensor([[s.response[-1]] for s in states])
        positions = torch.tensor([[s.length - 1] for s in states])
        timer = Timer()
        out = self._forward_slots(ids, positions, states)
        times = self.times
        times.decode_seconds += timer.lap()
        times.decode_steps += 1
        times.decode_tokens += len(states)
        if self.is_moe:
            routed = out.routed_experts[:, 0].to(torch.int32).cpu().numpy()
            for b, s in enumerate(states):
                s.routed.append(routed[b : b + 1])
        hidden = None if out.hidden is None else out.hidden[:, -1]
        return self._emit(states, out.logits[:, -1], hidden)

    def _forward_slots(self, ids: torch.Tensor, positions: torch.Tensor, states: list[_Running]):
        """The policy over the rows of `states` (in slot order), each in its own cache slot."""
        slots = None  # every slot of [0, len(states)) busy (the common case): rows are slots
        if states[-1].slot + 1 != len(states):
            slots = torch.tensor([s.slot for s in states])
        if any(s.rope_offset for s in states):  # rows after images rotate from their M-RoPE position
            offsets = torch.tensor([s.rope_offset for s in states])
            return self.decode_step.decode(ids, positions, self.cache, slots, rope_offsets=offsets)
        return self.decode_step.decode(ids, positions, self.cache, slots)

    def _emit(
        self, states: list[_Running], logits: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> list[Sample]:
        """Sample one token for each state from `logits` (computed from `hidden`); finish the ones
        that stop."""
        tokens, logprobs = self.sampler.sample(
            logits, [s.request for s in states], [s.uniforms or s.generator for s in states]
        )
        finished = []
        for b, (s, tok, lp) in enumerate(zip(states, tokens.tolist(), logprobs.tolist())):
            sample = self._append(s, tok, lp, None if hidden is None else hidden[b])
            if sample is not None:
                finished.append(sample)
        return finished

    def _append(
        self, s: _Running, token: int, logprob: float, feature: torch.Tensor | None = None
    ) -> Sample | None:
        """Add one generated token to a request (sampled from logits computed from `feature`, the
        policy's final hidden state); its sample when this token ends it."""
        if feature is not None and self.draft is not None:
            self.draft.see(s.slot, feature)
            if self.draft.records_features:
                s.features.append(feature)
        s.response.append(token)
        s.logprobs.append(logprob)
        s.token_versions.append(self.weight_version)
        if not s.versions or s.versions[-1] != self.weight_version:
            s.versions.append(self.weight_version)
        stop = self._stop_status(s, token)
        return None if stop is None else self._finish(s, *stop)

    def _stop_status(self, s: _Running, token: int) -> tuple[Status, dict] | None:
        """(status, SGLang-style finish_reason) when this token ends the request."""
        p = s.request.params
        if token in s.stop_ids:
            return Status.COMPLETED, {"type": "stop", "matched": token}
        if p.stop:
            tail = self.tokenizer.decode(s.response[-64:], skip_special_tokens=False)
            for stop in p.stop:
                if stop in tail:
                    return Status.COMPLETED, {"type": "stop", "matched": stop}
        if len(s.response) >= p.max_new_tokens or s.length >= self.max_seq_len:
            return Status.TRUNCATED, {"type": "length", "length": len(s.response)}
        return None

    def _finish(self, s: _Running, status: Status, reason: dict | None = None) -> Sample:
        if self._running.pop(s.slot, None) is not None:  # it held a slot: its reservation ends
            self._reserved -= self._reservation(s.request)
            if self.cache is not None and s.length * self.cache.bytes_per_token > KEEP_SLOT_BYTES:
                self.cache.release(s.slot)  # its pages go back (a short one's stay, for the next request)
        req = s.request
        sample = req.sample if req.sample is not None else Sample()
        if req.images is not None:  # the pixels the prompt was generated from go on to training
            sample.multimodal_train_inputs = req.images
        sample.tokens = list(req.prompt_ids) + s.response
        sample.response_length = len(s.response)
        sample.rollout_log_probs = s.logprobs
        sample.loss_mask = [1] * len(s.response)
        sample.status = status
        sample.weight_versions = s.versions
        sample.token_versions = s.token_versions
        sample.metadata["request_id"] = req.uid
        sample.metadata["finish_reason"] = reason or {"type": "abort"}
        if self.tokenizer is not None:
            sample.response = self.tokenizer.decode(s.response, skip_special_tokens=True)
        if self.draft is not None:
            self.draft.observe(sample.tokens)
            if s.features and len(s.features) == len(s.response):
                sample.draft_features = torch.stack(s.features).to(torch.float16).cpu().numpy()
        if self.is_moe:
            # every token fed through the model: all but the newest -> (tokens - 1, layers, k)
            routed = np.concatenate(s.routed) if s.routed else np.zeros((0,), np.int32)
            sample.rollout_routed_experts = routed[: len(sample.tokens) - 1]
        return sample

    def _abort_everything(self) -> list[Sample]:
        before, self._abort_before = self._abort_before, None
        finished = [
            self._finish(s, Status.ABORTED)
            for s in list(self._running.values())
            if s.request.arrival < before
        ]
        kept = deque(r for r in self._waiting if r.arrival >= before)
        for req in (r for r in self._waiting if r.arrival < before):
            finished.append(self._finish(_Running(req, slot=-1, generator=torch.Generator()), Status.ABORTED))
        self._waiting = kept
        return finished
