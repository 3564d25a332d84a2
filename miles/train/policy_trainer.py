"""The policy trainer: recompute log-probs, compute the RL loss, step AdamW.

One `train(samples, advantages)` call is one rollout's worth of training: the samples are split
into `num_steps_per_rollout` optimizer steps of `global_batch_size`, each accumulated over
micro-batches. Every micro-batch's loss is divided by the whole global batch's token (or
sequence) count, summed over data-parallel ranks, so the accumulated gradient and the logged
loss are the global batch's whatever the micro-batch size or rank count. Samples whose
advantage is 0 everywhere add nothing to that sum, so they are not run at all where nothing else
reads them (`skips_zero_advantage`): a GRPO step pays only for its groups with a signal. A step
whose loss or gradient is not finite is skipped and counted; the weights are never updated with NaN.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from miles.algo.distill import attach_topk, sample_topk, topk_of, topk_reverse_kl
from miles.algo.losses import cispo_loss, kl_estimate, opsm_keep, policy_loss
from miles.algo.masked import aggregate, masked_mean
from miles.algo.mismatch import importance_weights, mismatch_metrics, routing_mismatch
from miles.config.schema import RunConfig
from miles.data.sample import Sample
from miles.devices import measure_peak, training_memory
from miles.errors import ConfigError
from miles.lora import adapters as lora
from miles.models.transformer import Transformer
from miles.quant.convert import fp8_metrics
from miles.sync.payload import published_weights
from miles.sync.transports import share
from miles.train.auto_batch import AutoBatch
from miles.train.batch import (
    PackedBatch,
    forward_logprobs,
    pack_samples,
    recorded_routing,
    scatter,
    vision_sensitivity,
)
from miles.train.host_optimizer import HostAdamW
from miles.train.micro_batches import fixed_micro_batches, split_to_count, token_micro_batches
from miles.train.moe_stats import LoadAccumulator, load_balancing_loss, router_entropy_sum, routing_counts
from miles.train.optimizer import adamw

log = logging.getLogger("miles")


def lr_lambda(cfg: RunConfig):
    train_cfg, total = cfg.train, cfg.rollout.num_rollout * cfg.train.num_steps_per_rollout

    def factor(step: int) -> float:
        if train_cfg.warmup_steps and step < train_cfg.warmup_steps:
            return (step + 1) / train_cfg.warmup_steps
        if train_cfg.lr_decay_style == "cosine":
            progress = min(1.0, (step - train_cfg.warmup_steps) / max(1, total - train_cfg.warmup_steps))
            floor = train_cfg.min_lr / train_cfg.lr
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return factor


def shares_prompts(cfg: RunConfig) -> bool:
    """Whether training computes each group's prompt once. Not under expert capacity (the drops of
    a forward depend on all its tokens) nor expert parallelism (every rank must run the same
    number of forwards, whatever its batch's prompts), nor under deterministic routing (a response's
    keys would sit after the padded prompt, at other offsets in the attention tiles than in the
    engine's cache, and round differently: without sharing, trainer and engine agree bitwise)."""
    train = cfg.train
    return (
        train.share_prompts
        and train.moe_capacity_factor is None
        and train.expert_model_parallel_size == 1
        and not cfg.algo.deterministic_expert_routing
    )


def sharded(cfg: RunConfig, world: int) -> bool:
    """FSDP over several ranks: every rank's forwards must agree in number and shape (each
    gathers the weights), whatever its own samples."""
    return world > 1 and cfg.train.data_parallel == "fsdp"


def uses_pad_free(cfg: RunConfig, world: int) -> bool:
    """Whether training forwards run pad-free (`Transformer.forward`): the same cases as prompt
    sharing (the forward's shape must not change what a token computes), and not under FSDP over
    several ranks (`sharded`)."""
    return (
        cfg.train.pad_free
        and cfg.train.moe_capacity_factor is None
        and cfg.train.expert_model_parallel_size == 1
        and not cfg.algo.deterministic_expert_routing
        and not sharded(cfg, world)
    )


def skips_zero_advantage(cfg: RunConfig, world: int) -> bool:
    """Whether samples without a gradient (`adds_gradient`) stay out of training forwards: only
    where no loss term but the policy loss reads them (an entropy bonus, a KL term or the MoE aux
    loss would) and ranks' forwards are not collective (FSDP over several ranks, expert
    parallelism: every rank must run the same forwards)."""
    algo, train = cfg.algo, cfg.train
    return (
        train.skip_zero_advantage
        and algo.entropy_coef == 0
        and kl_loss_coef(cfg) == 0
        and not algo.opd_topk
        and train.aux_loss_coef == 0
        and train.expert_model_parallel_size == 1
        and not sharded(cfg, world)
    )


def adds_gradient(sample: Sample, advantage: torch.Tensor) -> bool:
    """Whether the policy loss of `sample` can have a gradient: some trained token has a non-zero
    advantage (every policy loss, clipped or not, is the advantage times a function of the ratio).
    A NaN advantage counts as non-zero, so a broken step still surfaces as one."""
    if sample.loss_mask is None:
        return bool((advantage != 0).any())
    # in Python: a tensor made of each sample's mask costs more than the few tokens it holds
    return any(a != 0 and m for a, m in zip(advantage.tolist(), sample.loss_mask))


# losses that add up over micro-batches and ranks (each part is already divided by the global
# batch's count); every other metric is a token-weighted mean
ADDITIVE_METRICS = ("loss", "pg_loss", "entropy", "kl_loss", "aux_loss")


def loss_denominator(samples: Sequence[Sample], agg: str) -> float:
    """What the loss aggregation divides by for these samples: their trained response tokens
    (token-mean) or their number (the per-sequence modes)."""
    if agg == "token-mean":
        return float(sum(sum(s.loss_mask) if s.loss_mask is not None else s.response_length for s in samples))
    return float(len(samples))


def response_positions(sample: Sample) -> slice:
    """The positions of a packed row (B, T - 1) whose targets are the sample's response tokens."""
    return slice(sample.prompt_length - 1, len(sample.tokens) - 1)


def needs_reference(cfg: RunConfig) -> bool:
    """A frozen reference model is kept when a KL term is on (loss or REINFORCE++ reward), and
    for on-policy distillation (the reference is then the teacher)."""
    algo = cfg.algo
    return (algo.use_kl_loss and algo.kl_loss_coef > 0) or algo.kl_coef > 0 or algo.teacher_in_trainer


def kl_loss_coef(cfg: RunConfig) -> float:
    """The weight of the KL-to-reference loss term (0: none): --kl-loss-coef, or --opd-kl-coef
    with --opd-type loss (the reference is the teacher)."""
    algo = cfg.algo
    if algo.teacher_in_trainer:
        return algo.opd_kl_coef if algo.opd_type == "loss" else 0.0
    return algo.kl_loss_coef if algo.use_kl_loss else 0.0


PEAK_KEY = {False: "peak_rss", True: "cuda_max_allocated"}  # what --memory-budget-gb bounds, by device


def padded_tokens(samples: Sequence[Sample]) -> int:
    """Tokens a micro-batch of `samples` computes: rows x the longest (packed) sample."""
    return len(samples) * max(len(s.tokens) - 1 for s in samples)


def auto_batch_for(cfg: RunConfig, model: Transformer, host_optimizer: bool) -> AutoBatch:
    """--auto-batch: refused when the budget cannot even hold the weights, their gradients and
    AdamW's two moments (before any activation)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    static = weights + trainable * (1 if host_optimizer else 3)
    budget = cfg.train.memory_budget_gb * 1e9
    if static > budget:
        raise ConfigError(
            f"--memory-budget-gb {cfg.train.memory_budget_gb:g} is below what training holds before any "
            f"activation: weights {weights / 1e9:.3f} GB + gradients {trainable / 1e9:.3f} GB"
            + ("" if host_optimizer else f" + AdamW state {2 * trainable / 1e9:.3f} GB")
            + f" = {static / 1e9:.3f} GB; give more than that"
        )
    return AutoBatch(budget, floor_tokens=1)


class PolicyTrainer:
    def __init__(
        self, model: Transformer, cfg: RunConfig, ref_model: Transformer | None = None, world: int = 1
    ) -> None:
        """`ref_model`: the frozen reference when KL is used (default: a copy of `model` now);
        `world`: data-parallel ranks, each training on its 1/world of every global batch."""
        self.model, self.cfg = model.train(), cfg
        self.device = model.lm_head.weight.device  # batches go there; metrics come back as floats
        train_cfg = cfg.train
        # --optimizer-cpu-offload on a GPU: the moments in host memory (a CPU run holds them there already)
        host = train_cfg.optimizer_cpu_offload and self.device.type != "cpu"
        if train_cfg.optimizer_cpu_offload and not host:
            log.info(
                "--optimizer-cpu-offload: training runs on CPU, its optimizer state is in host memory already"
            )
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
        options = dict(
            lr=train_cfg.lr,
            betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
            weight_decay=train_cfg.weight_decay,
        )
        if host:
            self.optimizer = HostAdamW(trainable, **options)
        else:
            self.optimizer = adamw(trainable, **options)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.ref_model = None
        # with LoRA the reference is the base: the policy with its adapters switched off, no copy
        self.lora_reference = needs_reference(cfg) and lora.spec_of(model) is not None
        if needs_reference(cfg) and not self.lora_reference:
            self.ref_model = (ref_model or copy.deepcopy(model)).eval().requires_grad_(False)
        self.skipped_steps = 0
        self.consecutive_skipped = 0  # optimizer steps skipped in a row (reset by a taken step)
        # set by a data-parallel runner: averages gradients over ranks, returns whether every rank is finite
        self.grad_sync = None
        # set by a data-parallel runner: sums a float64 tensor over ranks (global counts and losses)
        self.all_sum = None
        # set by an expert-parallel runner: clips by the whole model's gradient norm, returns it
        self.clip_grads = None
        self.world = world  # data-parallel ranks, whose averaged gradients the loss scale undoes
        # this rank's share of each optimizer step, and of each forward/backward
        self.step_samples = cfg.train.global_batch_size // world
        self.micro_samples = cfg.train.micro_samples(world)
        # --use-dynamic-batch-size: padded tokens per micro-batch (None: cut by --micro-batch-size)
        self.token_budget = cfg.train.max_tokens_per_gpu if cfg.train.use_dynamic_batch_size else None
        # set by a runner whose forwards are collective (FSDP, expert parallelism): the largest of an int
        # over ranks, so every rank runs as many micro-batches as the busiest
        self.all_max = None
        self.auto = auto_batch_for(cfg, model, host) if cfg.train.auto_batch else None

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "consecutive_skipped": self.consecutive_skipped,
        }

    @torch.no_grad()
    def reset_reference(self, weights: dict[str, torch.Tensor] | None = None) -> None:
        """Make the KL reference the policy as it is now, or `weights` (HF-named, as `hf_weights`
        gives them): co-evolution's moving reference (--magnet-kl-coef)."""
        if self.ref_model is None:
            raise ConfigError("a moving KL reference needs the trainer's reference model (--use-kl-loss)")
        source = weights if weights is not None else published_weights(self.model)
        for name, tensor in published_weights(self.ref_model).items():
            tensor.copy_(source[name])

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skipped = state.get("consecutive_skipped", 0)

    @property
    def policy(self) -> Transformer:
        """The policy the driver checkpoints: this trainer's own model."""
        return self.model

    def sync_policy(self) -> None:
        """The driver's policy is this trainer's own model here: nothing to fetch (the Ray
        trainer's version copies rank 0's weights)."""

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The weights to publish, by Hugging Face name (views of the model's own tensors); with
        LoRA the adapters alone (`miles.sync.payload`)."""
        return published_weights(self.model)

    def share_weights(self) -> None:
        """Zero-copy sync: move the weights into shared memory once; the optimizer keeps updating
        them there."""
        share(self.hf_weights().items())

    def weight_handles(self) -> bytes | None:
        """None: an engine in this process reads the tensors themselves (`send_shared`)."""
        return None

    def node_ids(self) -> list[str]:
        """Ray nodes this trainer runs on beyond the driver's: none."""
        return []

    def peak_memory(self) -> list[dict[str, int]]:
        """Its weights, gradients and optimizer state; its peak RSS is the driver's (`mem_driver_*`)."""
        return [training_memory(self.model, self.optimizer)]

    def set_precision(self, mode: str) -> None:
        """bf16 (precision warm-up) or fp8 for the FP8 layers of the policy and the reference."""
        from miles.quant.convert import set_mode

        for model in (self.model, self.ref_model):
            if model is not None:
                set_mode(model, mode)

    def offload(self) -> int:
        """Move weights, gradients and optimizer state (and the reference model) to CPU while a
        colocated engine uses the GPU; bytes moved. Nothing to do when training runs on CPU."""
        if self.device.type == "cpu" or not self._can_offload():
            return 0
        return self._move_to(torch.device("cpu"))

    def onload(self) -> int:
        """Bring everything `offload` moved back to the training device."""
        if self.device.type == "cpu" or not self._can_offload():
            return 0
        return self._move_to(self.device)

    def _can_offload(self) -> bool:
        """Plain tensors only: FSDP2's sharded DTensors are managed by FSDP, and moving their
        storage by hand would leave FSDP's own views on the device (said once, then skipped)."""
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            if not getattr(self, "_said_no_offload", False):
                log.warning(
                    "--colocate with --data-parallel fsdp: the trainer's sharded state stays on the GPU during "
                    "rollouts (only the engines free memory); use --data-parallel ddp to offload it too"
                )
                self._said_no_offload = True
            return False
        return True

    @torch.no_grad()
    def _move_to(self, device: torch.device) -> int:
        moved = 0
        models = [self.model] + ([self.ref_model] if self.ref_model is not None else [])
        for p in (p for m in models for p in m.parameters()):
            if p.device != device:
                moved += p.numel() * p.element_size()
                p.data = p.data.to(device)
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        for state in [] if isinstance(self.optimizer, HostAdamW) else self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device != device and value.dim() > 0:
                    moved += value.numel() * value.element_size()
                    state[key] = value.to(device)
        return moved

    def micro_batches(self, indices: Sequence[int], samples: Sequence[Sample]) -> list[list[int]]:
        """`indices` of `samples` cut into micro-batches: by count, or by padded tokens
        (`miles.train.micro_batches`)."""
        budget = self.auto.tokens if self.auto is not None else self.token_budget
        if budget is None:
            batches = fixed_micro_batches(indices, self.micro_samples)
        else:
            batches = token_micro_batches(indices, [len(s.tokens) - 1 for s in samples], budget)
        if self.all_max is not None:
            batches = split_to_count(batches, self.all_max(len(batches)))
        return batches

    def _plan(self, indices: list[int], samples: Sequence[Sample]):
        """The step's micro-batches; under --auto-batch each is cut with the budget its
        predecessors' measurements chose (all at once where ranks must agree on the count)."""
        if self.auto is None or self.all_max is not None:
            yield from self.micro_batches(indices, samples)
            return
        self.auto.floor = max(self.auto.floor, max(len(samples[i].tokens) - 1 for i in indices))
        remaining = list(indices)
        while remaining:
            first, *rest = self.micro_batches(remaining, samples)
            yield first
            remaining = [i for part in rest for i in part]

    @torch.no_grad()
    def logprobs(
        self, samples: Sequence[Sample], model: Transformer | None = None, replay: bool = True, topk: int = 0
    ) -> list[torch.Tensor]:
        """Per-sample response log-probs under `model` (default: the policy), micro-batched;
        `replay`: with --use-r3, through the experts the rollout chose (not for a teacher);
        `topk`: the same forward also sets the model's top-k per response position on each sample
        (`attach_topk`: a loaded --use-opd teacher's, as a teacher server's answer does)."""
        model = model or self.model
        temperature = self.cfg.rollout.logprob_temperature
        out: list[torch.Tensor | None] = [None] * len(samples)
        for part in self.micro_batches(range(len(samples)), samples):
            chunk = [samples[i] for i in part]
            batch = pack_samples(
                chunk,
                self.cfg.algo.use_r3 and replay,
                shares_prompts(self.cfg),
                not sharded(self.cfg, self.world),
            )
            result = forward_logprobs(
                model, batch, temperature, bool(topk), uses_pad_free(self.cfg, self.world)
            )
            # each sample's response log-probs: its run of the batch's response rows
            flat = result.logprobs.reshape(-1).index_select(0, batch.response_rows.to(result.logprobs.device))
            per_sample = flat.split([c.response_length for c in chunk])
            for b, (i, s, logp) in enumerate(zip(part, chunk, per_sample)):
                out[i] = logp
                if topk:
                    attach_topk(s, *topk_of(result.logits[b, response_positions(s)], topk, temperature))
        return out  # type: ignore[return-value]

    def reference_kl(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per-token log pi - log pi_ref of each response (the KL penalty REINFORCE++ folds into
        its rewards); needs the reference model, which a positive --kl-coef creates."""
        with torch.no_grad():
            return [o - r for o, r in zip(self.logprobs(samples), self.reference_logprobs(samples))]

    def reference_logprobs(self, samples: Sequence[Sample]) -> list[torch.Tensor] | None:
        """Log-probs under the KL reference (None when no KL term is on)."""
        if self.lora_reference:
            with lora.disabled(self.model):
                return self.logprobs(samples)
        if self.ref_model is None:
            return None
        # a teacher (--use-opd) routes its own experts; the initial policy's copy replays the rollout's
        return self.logprobs(samples, self.ref_model, replay=not self.cfg.algo.teacher_in_trainer)

    def teacher_logprobs(self, samples: Sequence[Sample], topk: int = 0) -> list[torch.Tensor]:
        """--opd-teacher-load: log pi_T of each response token (the KL reference is the teacher),
        and with `topk` its top-k per response position set on each sample."""
        return self.logprobs(samples, self.ref_model, replay=False, topk=topk)

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        if self.all_sum is None:
            return values
        return self.all_sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def train(self, samples: Sequence[Sample], advantages: Sequence[torch.Tensor]) -> dict[str, float]:
        """One rollout of training; `advantages[i]` is per response token of sample i."""
        cfg = self.cfg
        gbs = self.step_samples
        steps = [list(range(start, min(start + gbs, len(samples)))) for start in range(0, len(samples), gbs)]
        signal = [[i for i in idx if adds_gradient(samples[i], advantages[i])] for idx in steps]
        trained = [self._trained(idx, useful, samples) for idx, useful in zip(steps, signal)]
        # With one optimizer step per rollout every micro-batch runs before the update, so the
        # "old" log-probs are the forward's own (detached): no extra forward pass.
        old: list[torch.Tensor | None] = [None] * len(samples)
        if cfg.train.num_steps_per_rollout > 1:
            needed = [i for part in trained for i in part]
            for i, logp in zip(needed, self.logprobs([samples[i] for i in needed])):
                old[i] = logp
        ref = self.reference_logprobs(samples) if kl_loss_coef(cfg) > 0 and not cfg.algo.opd_topk else None
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)

        def record(name: str, value, weight: float = 1.0) -> None:
            sums[name] += float(value) * weight
            weights[name] += weight

        self.load = LoadAccumulator()  # MoE load over this call's micro-batches
        highest = 0  # --auto-batch: the largest micro-batch peak measured in this call
        if self.auto is not None:
            self.auto.start_step()
        agg = cfg.algo.loss_agg_mode
        for idx, useful, active in zip(steps, signal, trained):
            # the global batch's count over every rank: each micro-batch's share of the loss
            denominator, active_denominator = self._sum_over_ranks(
                [
                    loss_denominator([samples[i] for i in idx], agg),
                    loss_denominator([samples[i] for i in active], agg),
                ]
            )
            denominator = max(denominator, 1.0)
            record("zero_adv_frac", 1 - len(useful) / len(idx), len(idx))
            self.optimizer.zero_grad(set_to_none=True)
            self.step_chosen = None  # --moe-aux-loss-type global: expert counts of the step so far
            finite = True
            step_losses: dict[str, float] = dict.fromkeys(ADDITIVE_METRICS, 0.0)
            for mi in self._plan(active, samples):
                chunk = [samples[i] for i in mi]
                started = time.perf_counter()
                measuring = self.auto is not None
                window = (
                    measure_peak(self.device, trim=not self.auto.settled) if measuring else nullcontext({})
                )
                with window as peak:
                    loss, parts = self._micro_batch(
                        chunk,
                        [advantages[i] for i in mi],
                        [old[i] for i in mi],
                        None if ref is None else [ref[i] for i in mi],
                        denominator,
                    )
                    if torch.isfinite(loss):
                        # ranks average their gradients; the world factor turns that into the global sum
                        (loss * self.world).backward()
                if self.auto is not None:
                    measured = peak[PEAK_KEY[self.device.type == "cuda"]]
                    self.auto.observe(padded_tokens(chunk), measured, time.perf_counter() - started)
                    highest = max(highest, measured)
                tokens = loss_denominator(chunk, "token-mean")
                for k, v in parts.items():
                    if k in step_losses:
                        step_losses[k] += v
                    else:
                        record(k, v, tokens)
                if not torch.isfinite(loss):
                    finite = False
                    break
            if self.grad_sync is not None:  # data parallelism: average gradients over ranks
                finite = self.grad_sync(finite)
            # the entropy metric: a mean over the trained samples (the loss terms are the batch's)
            step_losses["entropy"] *= denominator / max(active_denominator, 1.0)
            present = [k for k in ADDITIVE_METRICS if k in parts]  # the same keys on every rank
            for k, v in zip(present, self._sum_over_ranks([step_losses[k] for k in present])):
                record(k, v)
            max_norm = cfg.train.clip_grad if cfg.train.clip_grad > 0 else float("inf")
            if self.clip_grads is not None:  # expert parallelism: the norm spans every rank's experts
                grad_norm = self.clip_grads(max_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
            if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor over the ranks
                grad_norm = grad_norm.full_tensor()
            if not finite or not torch.isfinite(grad_norm):
                self.skipped_steps += 1
                self.consecutive_skipped += 1
                if self.consecutive_skipped == 1:
                    log.warning(
                        "optimizer step skipped: the %s is not finite (loss %s, grad norm %s); the weights are kept",
                        "loss" if not finite else "gradient",
                        step_losses["loss"],
                        float(grad_norm),
                    )
                self.optimizer.zero_grad(set_to_none=True)
                record("skipped_step", 1)
                continue
            self.consecutive_skipped = 0
            record("grad_norm", grad_norm)
            record("lr", self.scheduler.get_last_lr()[0])
            self.optimizer.step()
            self.scheduler.step()
            record("skipped_step", 0)
        out = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
        if self.load.chosen is not None:  # the same layers and experts on every rank
            out.update(self.load.metrics(self._sum_over_ranks(self.load.flat())))
        out["consecutive_skipped_steps"] = self.consecutive_skipped
        if self.auto is not None:
            self.auto.end_step()
            out["auto_batch_tokens"] = self.auto.tokens
            out["auto_batch_peak_gb"] = highest / 1e9
        out.update(fp8_metrics(self.model))
        if self.policy.config.is_vision_language:  # the doctor's blind check reads it
            change = vision_sensitivity(self.model, samples, cfg.rollout.logprob_temperature)
            if change is not None:
                out["vision_logprob_change"] = change
        return out

    def _trained(self, idx: list[int], useful: list[int], samples: Sequence[Sample]) -> list[int]:
        """The samples of the global batch `idx` that the step's forwards run: all of them, or
        with `skips_zero_advantage` the `useful` ones (those that add a gradient). When none
        does, the shortest still runs: AdamW must step on zero gradients (its moments decay,
        weight decay applies) exactly as it would have, on every tensor a forward reaches."""
        if self.all_max is not None or not skips_zero_advantage(self.cfg, self.world):
            return idx
        return useful or [min(idx, key=lambda i: len(samples[i].tokens))]

    def _micro_batch(
        self, samples, advantages, old, ref, denominator: float
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """This micro-batch's share of the global batch's loss (its sums / `denominator`), and
        its metrics: the `ADDITIVE_METRICS` as shares, the rest as this micro-batch's means."""
        cfg, algo = self.cfg, self.cfg.algo
        batch: PackedBatch = pack_samples(
            samples, algo.use_r3, shares_prompts(cfg), not sharded(cfg, self.world)
        ).to(self.device)
        result = forward_logprobs(
            self.model,
            batch,
            cfg.rollout.logprob_temperature,
            bool(algo.opd_topk),
            uses_pad_free(cfg, self.world),
        )
        logp, logits, out = result.logprobs, result.logits, result.out
        mask = batch.response_mask
        resp_rows = batch.response_rows  # every response token, sample by sample (lists concatenated)

        def spread(values: torch.Tensor) -> torch.Tensor:
            return scatter(values.to(logp), resp_rows, logp)

        own = logp.detach().reshape(-1).index_select(0, resp_rows)  # "old" with one update a rollout
        if any(o is not None for o in old):
            parts_of = own.split([s.response_length for s in samples])
            own = torch.cat([o if o is not None else p for o, p in zip(old, parts_of)])
        adv, old_t = spread(torch.cat(list(advantages))), spread(own)
        has_rollout = all(s.rollout_log_probs is not None for s in samples)
        rollout_t = torch.zeros_like(logp)
        if has_rollout:
            rollout_t = spread(torch.tensor([x for s in samples for x in s.rollout_log_probs]))
        ref_t = spread(torch.cat(list(ref))) if ref is not None else torch.zeros_like(logp)
        parts: dict[str, float] = {}
        weights = None
        if has_rollout:
            parts.update(mismatch_metrics(old_t, rollout_t, mask))
        if algo.use_tis and has_rollout:
            w = importance_weights(
                old_t,
                rollout_t,
                mask,
                algo.tis_level,
                algo.tis_mode,
                algo.tis_clip,
                algo.tis_clip_low,
                algo.tis_threshold,
            )
            weights = w.weights
            parts.update(tis_mean=float(w.mean), tis_clipfrac=float(w.clipfrac))
        if algo.use_opsm:  # behaviour policy: the engine's log-probs where recorded
            keep = opsm_keep(logp, rollout_t if has_rollout else old_t, adv, mask, algo.opsm_delta)
            parts["opsm_masked_frac"] = float(masked_mean(1.0 - keep, mask.float()))
            weights = keep if weights is None else weights * keep
        agg, norm = algo.loss_agg_mode, cfg.rollout.rollout_max_response_len
        if algo.policy_loss == "cispo":
            eps_high = algo.eps_clip if algo.eps_clip_high is None else algo.eps_clip_high
            pl = cispo_loss(logp, old_t, adv, mask, eps_high, agg, norm, weights, denominator)
        else:
            pl = policy_loss(
                logp, old_t, adv, mask, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c,
                ratio_type="sequence" if algo.advantage_estimator == "gspo" else "token",
                agg=agg, norm_length=norm, token_weights=weights, denominator=denominator,
            )  # fmt: skip
        loss = pl.loss
        parts.update(
            pg_loss=float(pl.loss.detach()),
            pg_clipfrac=float(pl.clipfrac),
            pg_dual_clipfrac=float(pl.dual_clipfrac),
            ppo_kl=float(pl.approx_kl),
        )
        if algo.entropy_coef > 0:
            ent = aggregate(result.entropy, mask, agg, norm, denominator)
            loss = loss - algo.entropy_coef * ent
        else:
            with torch.no_grad():
                ent = aggregate(result.entropy.detach(), mask, agg, norm, denominator)
        parts["entropy"] = float(ent.detach())
        if ref is not None and (coef := kl_loss_coef(self.cfg)) > 0:
            kl = aggregate(kl_estimate(logp, ref_t, algo.kl_loss_type), mask, agg, norm, denominator)
            loss = loss + coef * kl
            parts["kl_loss"] = float(kl.detach())
        elif cfg.algo.opd_topk:  # the binned KL to the teacher's top-k (--opd-topk-per-position)
            per_token = torch.zeros_like(logp)
            temperature = cfg.rollout.logprob_temperature
            for b, s in enumerate(samples):
                rows = response_positions(s)
                per_token[b, rows] = topk_reverse_kl(
                    logits[b, rows], *sample_topk(s, logp.device), temperature
                )
            kl = aggregate(per_token, mask, agg, norm, denominator)
            loss = loss + algo.opd_kl_coef * kl
            parts["kl_loss"] = float(kl.detach())
        if out.routed_experts is not None:
            loss = loss + self._moe_terms(out, batch, samples, denominator, parts)
        parts["loss"] = float(loss.detach())
        return loss, parts

    def _moe_terms(self, out, batch: PackedBatch, samples, denominator: float, parts: dict) -> torch.Tensor:
        """The aux loss share of this micro-batch (0 when off); records load counts and the
        train/rollout routing mismatch, over every real position of the padded batch."""
        cfg = self.cfg
        mask = batch.attention_mask
        # R3 packed the recorded routing in the padded layout, unless a shared-prompt plan carries it
        weight, recorded = mask, batch.forced_experts
        if out.routing_rows is not None:  # packed groups: a row counts once for each position it stands for
            rows = out.routed_experts.shape[:2]
            weight = torch.bincount(out.routing_rows[mask.bool()], minlength=rows.numel()).view(rows)
            recorded = batch.shared.group_forced
        chosen, kept = routing_counts(out.routed_experts, weight, self.model.config.num_experts)
        every_layer = torch.stack([lg.detach() for lg in out.router_logits], dim=2)  # (rows, T, layers, E)
        self.load.add(chosen, kept, router_entropy_sum(every_layer, weight), float(mask.sum()))
        aux_share = torch.zeros((), device=self.device)
        if cfg.train.aux_loss_coef > 0:
            counts = chosen
            if (
                cfg.train.moe_aux_loss_type == "global"
            ):  # pooled over ranks and the step's micro-batches so far
                counts = torch.tensor(self._sum_over_ranks(chosen.reshape(-1).tolist()), dtype=torch.float64)
                counts = counts.view_as(chosen) + (0 if self.step_chosen is None else self.step_chosen)
                self.step_chosen = counts
            # a product of batch statistics, not a sum over tokens: computed per micro-batch (as
            # Megatron does) and weighted by the micro-batch's share of the global batch
            aux = load_balancing_loss(out.router_logits, weight, counts)
            aux = aux * loss_denominator(samples, cfg.algo.loss_agg_mode) / denominator
            aux_share = cfg.train.aux_loss_coef * aux
            parts["aux_loss"] = float(aux.detach())
        if all(s.rollout_routed_experts is not None for s in samples):
            if recorded is None:
                recorded = recorded_routing(samples, mask.shape[1])
            parts.update(routing_mismatch(every_layer, recorded, weight))
        return aux_share
