"""Where trainer and engine part: `miles doctor --localize-mismatch RUN_DIR`.

A run with --mismatch-dump-interval keeps a few samples with the trainer's weights and the
engine's served weights (`mismatch_dump`). This replays each sample through both sides as they
run: the trainer's full-sequence forward (routing replayed under --use-r3, as in training) and
the engine's model fed as the engine feeds it (the prompt in one prefill, then one token a step
over a KV cache). Every op's output is recorded (embedding, each norm, attention, router, MoE
or MLP, final norm, lm_head, log-probs) and compared in forward order; the first point whose
relative difference exceeds the tolerance is where the sides part. That module is then checked
alone: each of its parts is run on the trainer's own input on both sides, which names the
weight (or the arithmetic) that differs rather than the damage it does downstream. Routing flips
are listed by layer and token. Finally the engine's recorded log-probs are set against its
replay, which tells a fault of the engine's decode step (the fused C++ step) from one of its
weights.

The engine side replays through the general forward: the fused step computes the same function
to fp32 rounding but exposes no intermediate values.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from miles.algo.logprobs import token_logprobs
from miles.config.loader import run_config
from miles.data.sample import Sample
from miles.diagnostics.mismatch_dump import MismatchDump, load_dump
from miles.models import registry
from miles.models.checkpoint import hf_state_dict
from miles.models.routing import top_k
from miles.models.transformer import MoE, Transformer
from miles.quant.convert import prepare_rollout_model, quantize_train_model
from miles.rollout.weights import apply_named_tensors

TOLERANCE = 1e-4  # relative difference above which two fp32 activations differ beyond rounding
LOGPROBS = "log-probs"


@dataclass
class Difference:
    point: str  # a module name in forward order, "<moe>.gate" for router logits, or "log-probs"
    max_abs: float
    rel: float  # max |a - b| / max |a| (log-probs: the absolute difference)


@dataclass
class RoutingFlip:
    sample: int
    layer: int  # index of the decoder layer
    token: int  # position in the sequence
    trainer: list[int]
    engine: list[int]


@dataclass
class Localization:
    rollout_id: int
    samples: int
    tolerance: float
    engine_weights: str  # where the engine side's weights came from
    points: list[Difference]  # every point, forward order, the worst over samples
    first: Difference | None  # the first point beyond the tolerance (None: agree to rounding)
    parts: list[Difference] = field(default_factory=list)  # the first point's parts on the same input
    flips: list[RoutingFlip] = field(default_factory=list)
    engine_step_gap: float | None = None  # max |recorded rollout log-prob - engine replay|

    @property
    def first_layer(self) -> int | None:
        """The decoder layer the first divergence is in (None: none, or outside the layers)."""
        if self.first is None or not self.first.point.startswith("model.layers."):
            return None
        return int(self.first.point.split(".")[2])

    @property
    def diverged(self) -> bool:
        return self.first is not None or bool(self.flips) or self.engine_step_diverged

    @property
    def engine_step_diverged(self) -> bool:
        return self.engine_step_gap is not None and self.engine_step_gap > self.tolerance


def points(model: Transformer) -> list[str]:
    """The compared points in forward order."""
    names = ["model.embed_tokens"]
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.self_attn", f"{p}.post_attention_layernorm"]
        names += [f"{p}.mlp.gate", f"{p}.mlp"] if isinstance(layer.mlp, MoE) else [f"{p}.mlp"]
    return names + ["model.norm", "lm_head", LOGPROBS]


class Recorder:
    """Forward hooks on the compared modules: each call's output as (tokens, features)."""

    def __init__(self, model: Transformer) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.routing: dict[int, list[torch.Tensor]] = defaultdict(list)  # MoE layer -> own top-k choices
        moe = {
            f"model.layers.{i}.mlp": i for i, la in enumerate(model.model.layers) if isinstance(la.mlp, MoE)
        }
        self.handles = []
        for name in points(model)[:-1]:
            if name.endswith(".mlp.gate"):
                continue  # recorded with its MoE layer
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_hook(self._hook(name, moe.get(name), module)))

    def _hook(self, name: str, layer: int | None, module: nn.Module):
        def record(_module, _args, output) -> None:
            if layer is not None:  # MoE: (output, router logits, routing record)
                y, logits, _ = output
                self.outputs[f"{name}.gate"].append(logits.detach().reshape(-1, logits.shape[-1]))
                probs = torch.softmax(logits.detach().float(), dim=-1)
                self.routing[layer].append(top_k(probs, module.top_k, module.routing.deterministic))
                output = y
            self.outputs[name].append(output.detach().reshape(-1, output.shape[-1]))

        return record

    def take(self) -> dict[str, torch.Tensor]:
        """Each point's calls joined along the tokens."""
        return {k: torch.cat(v) for k, v in self.outputs.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _difference(point: str, a: torch.Tensor, b: torch.Tensor) -> Difference:
    a, b = a.double(), b.double()
    gap = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(a.abs().max()) if a.numel() else 0.0
    return Difference(point, gap, gap if point == LOGPROBS else gap / max(scale, 1e-30))


def _forced(sample: Sample, n: int) -> torch.Tensor | None:
    if sample.rollout_routed_experts is None:
        return None
    return torch.as_tensor(sample.rollout_routed_experts[:n]).long()[None]


def trainer_forward(model: Transformer, ids: torch.Tensor, forced: torch.Tensor | None) -> torch.Tensor:
    """The trainer's full-sequence forward (routing replayed when given) -> logits (T, V)."""
    return model(ids[None], forced_experts=forced).logits[0]


def engine_forward(model: Transformer, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """The engine's feeding: the prompt in one prefill, then one token a step over a KV cache."""
    cache = model.new_cache(1, len(ids) + 1)
    slot = torch.tensor([0])
    logits = [
        model(ids[None, :prompt], positions=torch.arange(prompt)[None], cache=cache, cache_rows=slot).logits[
            0
        ]
    ]
    for t in range(prompt, len(ids)):
        step = model(ids[None, t : t + 1], positions=torch.tensor([[t]]), cache=cache, cache_rows=slice(0, 1))
        logits.append(step.logits[0])
    return torch.cat(logits)


def build_sides(run_dir: Path, dump: MismatchDump) -> tuple[Transformer, Transformer, object, str]:
    """(trainer model, engine model, the run's config, where the engine's weights came from)."""
    cfg = run_config(Path(run_dir) / "config.yaml")
    base = registry.model_for(cfg.model.model, seed=cfg.train.seed)
    trainer = quantize_train_model(copy.deepcopy(base), cfg)
    trainer.load_state_dict(dump.trainer)
    engine = prepare_rollout_model(copy.deepcopy(base), cfg)
    if dump.engine is not None:
        engine.load_state_dict(dump.engine)
        source = "as the engine served them"
    else:
        apply_named_tensors(engine, hf_state_dict(trainer).items())
        source = "rebuilt from the trainer's (this rollout cannot read its weights back)"
    return trainer.eval(), engine.eval(), cfg, source


def record(
    model: Transformer, forward, args: tuple, targets: torch.Tensor, window: slice, temperature: float
):
    """(each point's output, each MoE layer's own top-k) of one `forward(model, *args)`."""
    recorder = Recorder(model)
    try:
        logits = forward(model, *args)
    finally:
        recorder.close()
    outputs = recorder.take()
    outputs[LOGPROBS] = token_logprobs(logits[window], targets[window], temperature)[:, None]
    return outputs, {k: torch.cat(v) for k, v in recorder.routing.items()}


@torch.no_grad()
def isolate(trainer: Transformer, engine: Transformer, point: str, inputs: list[tuple]) -> list[Difference]:
    """Each part of `point` that holds weights, run on both sides on the trainer's own input,
    worst first: the part whose own output differs is the fault, not its downstream damage."""
    root = point.removesuffix(".gate") if point.endswith(".mlp.gate") else point
    names = [
        f"{root}.{n}" if n else root
        for n, m in trainer.get_submodule(root).named_modules()
        if any(True for _ in m.parameters(recurse=False))
    ]
    seen: dict[str, list[tuple]] = defaultdict(list)
    handles = [
        trainer.get_submodule(n).register_forward_hook(lambda _m, args, out, n=n: seen[n].append((args, out)))
        for n in names
    ]
    try:
        for args in inputs:
            trainer_forward(trainer, *args)
    finally:
        for h in handles:
            h.remove()
    parts = []
    for name in names:
        calls = seen.get(name, [])
        if not calls:
            continue
        mine = torch.cat([out.reshape(-1, out.shape[-1]) for _, out in calls])
        other = engine.get_submodule(name)
        theirs = torch.cat([other(*args).reshape(-1, mine.shape[-1]) for args, _ in calls])
        parts.append(_difference(name, mine, theirs))
    return sorted(parts, key=lambda d: d.rel, reverse=True)


@torch.no_grad()
def localize(run_dir: str | Path, tolerance: float = TOLERANCE) -> Localization:
    """Replay the run's dumped samples on both sides; see the module docstring."""
    dump = load_dump(Path(run_dir))
    trainer, engine, cfg, source = build_sides(Path(run_dir), dump)
    temperature = cfg.rollout.logprob_temperature
    worst: dict[str, Difference] = {}
    flips: list[RoutingFlip] = []
    step_gap = None
    inputs = []
    for index, sample in enumerate(dump.samples):
        tokens = torch.tensor(sample.tokens)
        ids, targets, prompt = tokens[:-1], tokens[1:], sample.prompt_length
        forced = _forced(sample, len(ids)) if cfg.algo.use_r3 else None
        inputs.append((ids, forced))
        window = slice(prompt - 1, None)  # the response tokens
        mine, my_routes = record(trainer, trainer_forward, (ids, forced), targets, window, temperature)
        theirs, their_routes = record(engine, engine_forward, (ids, prompt), targets, window, temperature)
        for name in points(trainer):
            d = _difference(name, mine[name], theirs[name])
            if name not in worst or d.rel > worst[name].rel:
                worst[name] = d
        for layer, chosen in my_routes.items():
            differ = (chosen.sort(-1).values != their_routes[layer].sort(-1).values).any(-1)
            for token in differ.nonzero().flatten().tolist():
                flips.append(
                    RoutingFlip(
                        index, layer, token, chosen[token].tolist(), their_routes[layer][token].tolist()
                    )
                )
        if sample.rollout_log_probs is not None:
            recorded = torch.tensor(sample.rollout_log_probs, dtype=torch.float64)
            gap = float((recorded - theirs[LOGPROBS][:, 0].double()).abs().max())
            step_gap = gap if step_gap is None else max(step_gap, gap)
    ordered = [worst[name] for name in points(trainer)]
    first = next((d for d in ordered if d.rel > tolerance), None)
    parts = []
    if first is not None and first.point != LOGPROBS:
        parts = isolate(trainer, engine, first.point, inputs)
    return Localization(
        dump.rollout_id, len(dump.samples), tolerance, source, ordered, first, parts, flips, step_gap
    )


def format_localization(result: Localization, step: str) -> str:
    """The doctor's text report; `step` names the engine's decode step (the run's setting)."""
    lines = [
        f"mismatch localisation: rollout {result.rollout_id}, {result.samples} samples, engine weights "
        f"{result.engine_weights}; tolerance {result.tolerance:g} (relative; log-probs absolute)"
    ]
    first = result.first
    if first is None:
        worst = max(result.points, key=lambda d: d.rel)
        lines.append(
            f"  no divergence beyond rounding: the largest difference is {worst.rel:.2e} at {worst.point}"
        )
    else:
        where = "" if result.first_layer is None else f"decoder layer {result.first_layer}; "
        lines.append(
            f"  first divergence: {first.point} ({where}max |diff| {first.max_abs:.3g}, relative {first.rel:.3g})"
        )
        culprits = [p for p in result.parts if p.rel > result.tolerance]
        if culprits:
            named = ", ".join(f"{p.point} ({p.rel:.3g})" for p in culprits[:3])
            lines.append(
                f"  on the same input its own output differs: {named}: the weights or arithmetic there"
            )
        elif result.parts:
            lines.append("  its parts agree on the same input: the difference is in how it combines them")
        after = result.points[result.points.index(first) :]
        layers: dict[str, float] = {}
        for d in after:
            key = ".".join(d.point.split(".")[:3]) if d.point.startswith("model.layers.") else d.point
            layers[key] = max(layers.get(key, 0.0), d.rel)
        growth = ", ".join(f"{k} {v:.2e}" for k, v in layers.items())
        lines.append(f"  downstream: {growth}")
    if result.flips:
        shown = "; ".join(
            f"sample {f.sample} layer {f.layer} token {f.token}: trainer {f.trainer} engine {f.engine}"
            for f in result.flips[:5]
        )
        lines.append(f"  routing flips: {len(result.flips)} ({shown})")
    if result.engine_step_gap is not None:
        verdict = "disagrees: a fault of the decode step itself" if result.engine_step_diverged else "agree"
        lines.append(
            f"  the engine's recorded log-probs ({step} step) vs its replay on the same weights: max "
            f"|diff| {result.engine_step_gap:.3g} ({verdict})"
        )
    return "\n".join(lines)
