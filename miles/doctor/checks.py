"""The doctor's checks: one small function per known symptom, registered in one table.

A check reads a run (and optionally a run to compare against) and returns a `Finding` when the
symptom is there: the evidence (metric, step, value, threshold), the likely cause, and remedies as
flags of `miles train` chosen by what the run already uses. A feature adds its own check with
`@check(...)`. Thresholds live in THRESHOLDS and are documented in docs/troubleshooting.md.
Some symptoms follow from others (a NaN run's reward collapses too): `explained_by` folds such a
finding under its cause instead of listing it as a second problem.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from miles.doctor.run import RunRecord

THRESHOLDS = {
    "grad_spike_ratio": 10.0,  # grad_norm above this multiple of the median of the steps before it
    "collapse_fraction": 0.5,  # reward fell below half of its best (smoothed)
    "collapse_min_best": 0.1,  # ... from a best of at least this (a run that never learned cannot collapse)
    "collapse_noise_sigmas": 3.0,  # ... by more than this many standard errors of a window's mean reward
    "mismatch_k3": 2e-4,  # median K3 KL(rollout || train) per token: twice a bf16 engine (~1.2e-4); FP8 ~0.06
    "mismatch_abs": 0.1,  # median mean |logp_train - logp_rollout| (slime's bound)
    "tis_clipfrac": 0.05,  # median fraction of tokens TIS truncates or masks
    "routing_mismatch": 0.005,  # median fraction of MoE top-k decisions that differ train vs rollout
    "expert_load": 3.0,  # median max/mean tokens per expert (top-k of E caps it at E/k)
    "expert_dropped": 0.1,  # median share of routed slots dropped over expert capacity
    "co_evolution_swing": 0.25,  # range of the last iterate's exploitability over the last half of the run
    "co_evolution_exploitability": 0.3,  # the average policy's exploitability at the end
    "co_evolution_dominance": 0.5,  # an agent's mean reward over the last quarter (|reward| per episode)
    "co_evolution_stuck": 0.5,  # exploitability of a frozen last iterate (deterministic policies) at the end
    "sync_share": 0.25,  # median weight-sync seconds / step seconds
    "memory_growth_gb": 0.2,  # per-step peak memory growth over the run, in GB ...
    "memory_growth_frac": 0.1,  # ... and as a fraction of where it started
    "truncated_frac": 0.25,  # median fraction of responses cut at --rollout-max-response-len
    "accuracy_gap": 0.05,  # final held-out accuracy below the --compare run's by this much
    "spec_accept": 0.5,  # median share of checked draft proposals the policy accepts
    "spec_drift": 0.05,  # acceptance of the last fifth of the run below the first fifth by this much
    "tool_error_frac": 0.3,  # median share of tool calls that end in an error observation
    "turn_limit_frac": 0.25,  # median share of conversations cut at --max-turns with a call pending
    "trajectory_cut_frac": 0.25,  # median share cut by the response budget (not the turn limit)
    "length_drift": 0.1,  # trained response length below the generated one by this fraction (async)
    "staleness_at_bound": 0.5,  # median share of trained samples as stale as --max-staleness allows
    "vision_change": 1e-4,  # median |log-prob change| of response tokens when the images are blanked
}


@dataclass
class Evidence:
    metric: str
    value: float
    step: int | None = None
    threshold: float | None = None
    note: str = ""

    def __str__(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        limit = f" (threshold {self.threshold:g})" if self.threshold is not None else ""
        note = f"; {self.note}" if self.note else ""
        return f"{self.metric} = {self.value:.4g}{where}{limit}{note}"


@dataclass
class Remedy:
    flags: list[str]  # to add to `miles train` (empty: advice that is not a flag)
    why: str


@dataclass
class Finding:
    check: str
    symptom: str
    cause: str
    evidence: list[Evidence]
    remedies: list[Remedy]
    explains: list[Finding] = field(default_factory=list)  # symptoms that follow from this one


@dataclass
class Check:
    name: str
    symptom: str
    run: Callable[[RunRecord, RunRecord | None], Finding | None]
    explained_by: tuple[str, ...] = ()


CHECKS: dict[str, Check] = {}


def check(name: str, symptom: str, explained_by: tuple[str, ...] = ()):
    """Register `fn(run, compare) -> (cause, evidence, remedies) | None` as the check `name`."""

    def register(fn):
        def run(record: RunRecord, compare: RunRecord | None) -> Finding | None:
            found = fn(record, compare)
            return Finding(name, symptom, *found) if found else None

        CHECKS[name] = Check(name, symptom, run, explained_by)
        return fn

    return register


def diagnose(run: RunRecord, compare: RunRecord | None = None) -> list[Finding]:
    """Every registered check on `run`; findings explained by another are folded under it."""
    found = {name: f for name, c in CHECKS.items() if (f := c.run(run, compare)) is not None}
    top = []
    for name, finding in found.items():
        cause = next((c for c in CHECKS[name].explained_by if c in found), None)
        (found[cause].explains if cause else top).append(finding)
    return top


# ---- helpers -----------------------------------------------------------------------------------


def _worst(run: RunRecord, key: str) -> tuple[int, float]:
    finite = [(s, v) for s, v in run.series(key) if math.isfinite(v)]
    return max(finite, key=lambda sv: sv[1])


def _median_over(run: RunRecord, metric: str, threshold: str, note: str = "") -> list[Evidence] | None:
    """The evidence that `metric`'s median over steps is above THRESHOLDS[threshold], or None."""
    median = run.median(metric)
    if median is None or median <= THRESHOLDS[threshold]:
        return None
    return [Evidence(metric, median, None, THRESHOLDS[threshold], note="median over steps" + note)]


def _is_moe(run: RunRecord) -> bool:
    return bool(run.series("routing_mismatch_frac") or run.series("expert_load_max_over_mean"))


def _fp8_training(run: RunRecord) -> bool:
    return bool(run.setting("precision.fp8_recipe")) and not run.setting("precision.fp8_rollout_only")


def _fp8_remedies(run: RunRecord) -> list[Remedy]:
    """The FP8 remedies (block scaling, FP32 scales, dynamic scaling, E4M3, bf16 warm-up) this run does not use yet (unified FP8 training only)."""
    if not _fp8_training(run):
        return []
    remedies = []
    if run.setting("precision.fp8_recipe") != "blockwise":
        remedies.append(
            Remedy(["--fp8-recipe", "blockwise"], "a scale per 128x128 block: one outlier spoils one block")
        )
    if not run.setting("precision.fp8_fp32_scales"):
        remedies.append(
            Remedy(
                ["--fp8-fp32-scales"],
                "FP32 scales instead of powers of two (= NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1)",
            )
        )
    if run.setting("precision.fp8_recipe") == "delayed" and not run.setting("precision.fp8_dynamic_scaling"):
        remedies.append(
            Remedy(["--fp8-dynamic-scaling"], "each tensor's own amax instead of a stale history")
        )
    if run.setting("precision.fp8_format") == "hybrid":
        remedies.append(
            Remedy(["--fp8-format", "e4m3"], "E4M3 everywhere: one more mantissa bit for gradients")
        )
    if not run.setting("train.warmup_precision"):
        remedies.append(
            Remedy(
                ["--warmup-steps", "100", "--warmup-precision", "bf16"],
                "start in bf16, switch to FP8 once stable",
            )
        )
    if not run.setting("precision.fp8_skip_layers"):
        remedies.append(
            Remedy(
                ["--fp8-skip-layers", "self_attn"],
                "attention projections in full precision (lm_head, embeddings, norms and routers always are)",
            )
        )
    return remedies


def _int4_remedies(run: RunRecord, accuracy: bool = False) -> list[Remedy]:
    """The INT4 QAT remedies this run does not use yet: finer groups, attention in full precision,
    a bf16 warm-up and, for accuracy that trails a reference (`accuracy`), a larger step."""
    if not run.setting("precision.int4_qat"):
        return []
    remedies = []
    group = run.setting("precision.int4_group_size") or 128
    if group // 2 >= 16 and group % 2 == 0:
        remedies.append(
            Remedy(
                ["--int4-group-size", str(group // 2)],
                f"groups of {group // 2}: the grid follows the weights closer",
            )
        )
    if not run.setting("precision.int4_skip_layers"):
        remedies.append(
            Remedy(
                ["--int4-skip-layers", "self_attn"],
                "attention projections in full precision, MLP/experts INT4",
            )
        )
    if not run.setting("train.warmup_precision"):
        remedies.append(
            Remedy(
                ["--warmup-steps", "100", "--warmup-precision", "bf16"],
                "start in bf16, switch to INT4 once stable",
            )
        )
    if accuracy:
        lr = run.setting("train.lr", 1e-6)
        remedies.append(
            Remedy(["--lr", f"{lr * 2:g}"], "QAT: updates under half a grid step do not move an INT4 weight")
        )
    return remedies


def _smoothed(values: list[float], k: int) -> list[float]:
    return [sum(values[i : i + k]) / k for i in range(len(values) - k + 1)]


# ---- training stability ------------------------------------------------------------------------


@check("loss_explosion", "the loss or gradient exploded (NaN/inf, skipped steps or a gradient-norm spike)")
def loss_explosion(run: RunRecord, compare: RunRecord | None):
    evidence = []
    bad = [
        (r["rollout"], k, float(r[k]))
        for r in run.steps
        for k in ("loss", "grad_norm")
        if isinstance(r.get(k), (int, float)) and not math.isfinite(r[k])
    ]
    skipped = [(s, v) for s, v in run.series("skipped_step") if v > 0]
    if bad:
        step, key, value = bad[0]
        evidence.append(Evidence(key, value, step, note=f"{len({s for s, *_ in bad})} steps not finite"))
    if skipped:
        evidence.append(
            Evidence(
                "skipped_step", skipped[0][1], skipped[0][0], note=f"{len(skipped)} steps skipped updates"
            )
        )
    norms = run.series("grad_norm")
    ratio = THRESHOLDS["grad_spike_ratio"]
    for i, (step, value) in enumerate(norms):
        before = sorted(v for _, v in norms[:i] if math.isfinite(v) and v > 0)
        if len(before) >= 3 and math.isfinite(value) and value > ratio * before[len(before) // 2]:
            evidence.append(
                Evidence(
                    "grad_norm",
                    value,
                    step,
                    note=f"{value / before[len(before) // 2]:.1f}x the median before it",
                )
            )
            break
    if not evidence:
        return None
    lr, clip = run.setting("train.lr", 1e-6), run.setting("train.clip_grad", 1.0)
    remedies = [Remedy(["--lr", f"{lr / 10:g}"], f"a tenth of this run's --lr {lr:g}: smaller updates")]
    if not clip:
        remedies.append(Remedy(["--clip-grad", "1.0"], "gradient clipping is off in this run"))
    if run.setting("train.num_steps_per_rollout", 1) > 1 and run.setting("algo.eps_clip_c") is None:
        remedies.append(
            Remedy(
                ["--eps-clip-c", "3"],
                "dual clip: bounds the loss of negative advantages whose ratio runs away",
            )
        )
    if not run.setting("train.warmup_steps", 0) and not _fp8_training(run):
        remedies.append(Remedy(["--warmup-steps", "10"], "warm the learning rate up over the first steps"))
    remedies += _fp8_remedies(run) + _int4_remedies(run)
    return (
        "updates too large for the model: learning rate, no clipping or an unbounded PPO ratio",
        evidence,
        remedies,
    )


@check(
    "reward_collapse",
    f"the reward fell from its best by more than {THRESHOLDS['collapse_fraction']:.0%} and stayed there",
    explained_by=("loss_explosion",),
)
def reward_collapse(run: RunRecord, compare: RunRecord | None):
    rewards = [v for v in run.values("reward_mean") if math.isfinite(v)]
    k = max(2, len(rewards) // 5)  # smooth over a fifth of the run: one bad batch is not a collapse
    if len(rewards) < 2 * k:
        return None
    best = max(_smoothed(rewards, k))
    floor = best * (1 - THRESHOLDS["collapse_fraction"])
    last = rewards[-k:]
    if best < THRESHOLDS["collapse_min_best"] or max(last) >= floor:
        return None
    # and beyond sampling noise: a window's mean of n rewards in [0, 1] varies by about
    # sqrt(p (1 - p) / n); small batches fall by half by chance (seen with 16 samples a step)
    n = k * (run.median("train_samples") or 1)
    noise = math.sqrt(max(best * (1 - best), 0.01) / n)
    if best - sum(last) / k < THRESHOLDS["collapse_noise_sigmas"] * noise:
        return None
    steps = [s for s, _ in run.series("reward_mean")]
    evidence = [
        Evidence(
            "reward_mean",
            sum(last) / k,
            steps[-1],
            floor,
            note=f"mean of the last {k} steps; best {best:.3f}",
        )
    ]
    lr = run.setting("train.lr", 1e-6)
    remedies = [
        Remedy(["--lr", f"{lr / 10:g}"], f"a tenth of this run's --lr {lr:g}: the policy moved too far")
    ]
    if not run.setting("algo.use_kl_loss"):
        remedies.append(
            Remedy(
                ["--use-kl-loss", "--kl-loss-coef", "0.01"], "a KL loss keeps the policy near the reference"
            )
        )
    if _is_moe(run) and not run.setting("algo.use_r3"):
        remedies.append(Remedy(["--use-r3"], "MoE: replay the rollout's routing in training"))
    remedies += _fp8_remedies(run) + _int4_remedies(run)
    return (
        "the policy left the region where it earned reward (too large steps, or off-policy updates)",
        evidence,
        remedies,
    )


@check(
    "truncation",
    f"more than {THRESHOLDS['truncated_frac']:.0%} of responses hit --rollout-max-response-len",
    explained_by=("loss_explosion", "reward_collapse", "turn_limit", "trajectory_budget"),
)
def truncation(run: RunRecord, compare: RunRecord | None):
    evidence = _median_over(run, "truncated_frac", "truncated_frac")
    if evidence is None:
        return None
    length = run.setting("rollout.rollout_max_response_len", 64)
    remedies = [
        Remedy(
            ["--rollout-max-response-len", str(length * 2)], f"twice this run's {length}: cut answers score 0"
        )
    ]
    return "responses are longer than the run lets them be", evidence, remedies


# ---- agents: tool calls and multi-turn conversations ---------------------------------------------

TOOL_ERROR_REMEDIES = {
    "timeout": lambda run: Remedy(
        ["--tool-timeout", f"{run.setting('agent.tool_timeout', 10.0) * 3:g}"], "calls are killed at the timeout"
    ),
    "memory": lambda run: Remedy(
        ["--tool-memory-mb", str(run.setting("agent.tool_memory_mb", 1024) * 4)], "calls hit the memory limit"
    ),
    "too_many_calls": lambda run: Remedy(
        ["--max-tool-calls", str(run.setting("agent.max_tool_calls", 8) * 2)], "calls past the limit are refused"
    ),
    "tool_raised": lambda run: Remedy([], "the tool itself raises: the error text is each call's result "
                                          "(metadata tool_call_log of --save-debug-rollout-data samples)"),
    "tool_died": lambda run: Remedy([], "the tool's process dies (a crash, or --tool-cpu-seconds spent): "
                                        "raise --tool-cpu-seconds or fix the tool"),
}  # fmt: skip
FORMAT_ERRORS = ("malformed_call", "unknown_tool", "bad_arguments")


@check(
    "tool_errors",
    f"more than {THRESHOLDS['tool_error_frac']:.0%} of tool calls end in an error",
    explained_by=("loss_explosion",),
)
def tool_errors(run: RunRecord, compare: RunRecord | None):
    evidence = _median_over(run, "tool_error_frac", "tool_error_frac")
    if evidence is None:
        return None
    kinds = {
        key.removeprefix("tool_errors_"): sum(run.values(key))
        for key in {k for r in run.steps for k in r if k.startswith("tool_errors_")}
    }
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    evidence += [Evidence(f"tool_errors_{k}", v, note="over the run") for k, v in ranked[:3]]
    remedies = [TOOL_ERROR_REMEDIES[k](run) for k, _ in ranked if k in TOOL_ERROR_REMEDIES]
    if any(k in FORMAT_ERRORS for k, _ in ranked[:2]):
        remedies.insert(
            0,
            Remedy(
                [],
                "the policy does not write calls the parser reads: warm-start it with `miles sft` on tool-use "
                "conversations, and check --tool-call-parser matches the format its chat template teaches",
            ),
        )
    top = ranked[0][0] if ranked else "unknown"
    return f"tool calls fail, mostly {top}", evidence, remedies


@check(
    "turn_limit",
    f"more than {THRESHOLDS['turn_limit_frac']:.0%} of conversations end at --max-turns with a call pending",
    explained_by=("tool_errors",),  # calls that fail are retried until the limit
)
def turn_limit(run: RunRecord, compare: RunRecord | None):
    evidence = _median_over(run, "trajectory_max_turns_frac", "turn_limit_frac")
    if evidence is None:
        return None
    turns = run.setting("agent.max_turns", 4)
    remedies = [
        Remedy(["--max-turns", str(turns * 2)], f"twice this run's {turns}: a cut conversation gives no answer"),
        Remedy([], "a policy that calls tools in a loop: check the tool results answer what it asks "
                   "(the tool_call_log of saved rollouts), or reward fewer calls"),
    ]  # fmt: skip
    return "conversations run out of turns before the policy answers", evidence, remedies


@check(
    "trajectory_budget",
    f"more than {THRESHOLDS['trajectory_cut_frac']:.0%} of conversations run out of response budget",
    explained_by=("tool_errors",),  # error results are long text
)
def trajectory_budget(run: RunRecord, compare: RunRecord | None):
    observed = f"; observation_tokens_mean {run.median('observation_tokens_mean') or 0:.0f}"
    evidence = _median_over(run, "trajectory_budget_frac", "trajectory_cut_frac", observed)
    if evidence is None:
        return None
    length = run.setting("rollout.rollout_max_response_len", 64)
    remedies = [
        Remedy(
            ["--rollout-max-response-len", str(length * 2)],
            f"twice this run's {length}: the budget covers every turn and every tool result",
        )
    ]
    if run.setting("agent.max_turn_tokens"):
        remedies.append(Remedy([], "or lower --max-turn-tokens so one long turn cannot spend the budget"))
    return "conversations (turns and tool results together) outgrow the response budget", evidence, remedies


# ---- train / rollout mismatch ------------------------------------------------------------------


def _mismatch_remedies(run: RunRecord) -> list[Remedy]:
    remedies = []
    if not run.setting("algo.use_tis"):
        remedies.append(
            Remedy(["--use-tis"], "truncated importance sampling reweights tokens by pi_train/pi_rollout")
        )
    if _is_moe(run) and not run.setting("algo.use_r3"):
        remedies.append(
            Remedy(["--use-r3"], "MoE: train with the experts the rollout chose (routing replay)")
        )
    if run.setting("precision.fp8_rollout_only"):
        remedies.append(
            Remedy(
                ["--no-fp8-rollout-only", "--fp8-recipe", run.setting("precision.fp8_recipe") or "blockwise"],
                "unified FP8: the trainer quantizes as the engine does, so both compute the same numbers",
            )
        )
        remedies.append(
            Remedy(
                [],
                "or remove --fp8-rollout-only: no FP8 on either side",
            )
        )
    if run.setting("precision.int4_rollout_only"):
        remedies.append(
            Remedy(
                ["--no-int4-rollout-only", "--int4-qat"],
                "INT4 QAT (= OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1): the trainer multiplies by the INT4 grid the "
                "engine serves, so both compute the same numbers",
            )
        )
    if not run.setting("algo.verify_logprobs"):
        remedies.append(
            Remedy(["--verify-logprobs"], "stop the run when the mean gap passes --verify-logprobs-threshold")
        )
    if not run.setting("debug.mismatch_dump_interval"):
        remedies.append(
            Remedy(
                ["--mismatch-dump-interval", "1"],
                "to find where: keep a few samples with both sides' weights, then `miles doctor "
                "--localize-mismatch RUN_DIR` names the first layer and op where trainer and engine part",
            )
        )
    return remedies


@check("logprob_mismatch", "the trainer's log-probs differ from the rollout engine's, uncorrected")
def logprob_mismatch(run: RunRecord, compare: RunRecord | None):
    k3, gap = run.median("kl_rollout_train_k3"), run.median("train_rollout_logprob_abs_diff")
    if k3 is None or gap is None or run.setting("algo.use_tis"):
        return None  # with TIS on, tis_clipping judges whether the correction copes
    if k3 <= THRESHOLDS["mismatch_k3"] and gap <= THRESHOLDS["mismatch_abs"]:
        return None
    step, worst = _worst(run, "kl_rollout_train_k3")
    evidence = [
        Evidence(
            "kl_rollout_train_k3",
            k3,
            None,
            THRESHOLDS["mismatch_k3"],
            note=f"median; worst {worst:.3g} at step {step}",
        ),
        Evidence("train_rollout_logprob_abs_diff", gap, None, THRESHOLDS["mismatch_abs"], note="median"),
    ]
    why = "the engine computes different numbers (precision, kernels"
    why += ", experts)" if _is_moe(run) else ")"
    return (
        f"samples come from pi_rollout but the loss assumes pi_train: {why}",
        evidence,
        _mismatch_remedies(run),
    )


@check("tis_clipping", f"TIS truncates or masks more than {THRESHOLDS['tis_clipfrac']:.0%} of tokens")
def tis_clipping(run: RunRecord, compare: RunRecord | None):
    frac = run.median("tis_clipfrac")
    if frac is None or not run.setting("algo.use_tis") or frac <= THRESHOLDS["tis_clipfrac"]:
        return None
    evidence = [Evidence("tis_clipfrac", frac, None, THRESHOLDS["tis_clipfrac"], note="median over steps")]
    remedies = []
    threshold = run.setting("algo.tis_threshold")
    if threshold is not None and threshold > 0.9:
        remedies.append(
            Remedy(["--tis-threshold", "0.9"], f"a wider trust band than {threshold:g}: fewer tokens masked")
        )
    if run.setting("algo.tis_clip", 2.0) < 2.0:
        remedies.append(Remedy(["--tis-clip", "2.0"], "the common upper bound C (slime, verl)"))
    remedies += [r for r in _mismatch_remedies(run) if r.flags != ["--use-tis"]]
    return (
        "the train/rollout mismatch is too large for TIS to correct without bias",
        evidence,
        remedies,
    )


@check("routing_mismatch", "MoE: the trainer picks other experts than the rollout engine did, and R3 is off")
def routing_mismatch(run: RunRecord, compare: RunRecord | None):
    frac = run.median("routing_mismatch_frac")
    if frac is None or run.setting("algo.use_r3") or frac <= THRESHOLDS["routing_mismatch"]:
        return None
    step, worst = _worst(run, "routing_mismatch_frac")
    evidence = [
        Evidence(
            "routing_mismatch_frac",
            frac,
            None,
            THRESHOLDS["routing_mismatch"],
            note=f"median; worst {worst:.3g} at step {step}",
        )
    ]
    tokens = run.median("routing_mismatch_token_frac")
    if tokens is not None:
        evidence.append(
            Evidence("routing_mismatch_token_frac", tokens, note="tokens with any layer routed differently")
        )
    in_flight = (
        2 * run.setting("rollout.rollout_batch_size", 32) * run.setting("rollout.n_samples_per_prompt", 8)
    )
    remedies = [
        Remedy(["--use-r3"], "Rollout Routing Replay: training uses the experts the engine chose"),
        Remedy(
            ["--use-r3", "--r3-buffer-size", str(max(1000, in_flight))],
            "the same, with the routing records' memory bounded (two steps of samples fit)",
        ),
    ]
    low_precision_engine = run.setting("precision.fp8_rollout_only") or run.setting(
        "precision.int4_rollout_only"
    )
    if not low_precision_engine and not run.setting("algo.deterministic_expert_routing"):
        remedies.append(
            Remedy(
                ["--deterministic-expert-routing"],
                "batch-invariant kernels in trainer and engine: the flips from batch size and padding go "
                "(not those of a lower-precision engine), at several times the step time (docs/algorithms.md)",
            )
        )
    return "near-tied router scores flip under small numeric differences", evidence, remedies


# ---- MoE, systems ------------------------------------------------------------------------------


def _next_aux_coef(run: RunRecord) -> str:
    """The load-balancing ladder: 0.01 first, then ten times the run's own coefficient."""
    coef = run.setting("train.aux_loss_coef", 0.0)
    return f"{0.01 if not coef else coef * 10:g}"


@check("expert_imbalance", "MoE: a few experts take most tokens")
def expert_imbalance(run: RunRecord, compare: RunRecord | None):
    load = run.median("expert_load_max_over_mean")
    if load is None or load <= THRESHOLDS["expert_load"]:
        return None
    evidence = [
        Evidence("expert_load_max_over_mean", load, None, THRESHOLDS["expert_load"], note="median over steps")
    ]
    remedies = [
        Remedy(
            ["--aux-loss-coef", _next_aux_coef(run)], "the load-balancing loss pushes tokens to idle experts"
        )
    ]
    if run.setting("train.moe_capacity_factor") is None:
        remedies.append(
            Remedy(
                ["--moe-capacity-factor", "1.25"],
                "bounds the busiest expert's slots near 1.25x the balanced share (memory and time per "
                "step); the slots over it are dropped, it does not teach the router",
            )
        )
    return (
        "the router collapsed onto a few experts; the others get no tokens and no gradient",
        evidence,
        remedies,
    )


@check(
    "expert_drops", f"MoE: expert capacity drops more than {THRESHOLDS['expert_dropped']:.0%} of routed slots"
)
def expert_drops(run: RunRecord, compare: RunRecord | None):
    frac = run.median("expert_dropped_frac")
    if frac is None or frac <= THRESHOLDS["expert_dropped"]:
        return None
    evidence = [
        Evidence("expert_dropped_frac", frac, None, THRESHOLDS["expert_dropped"], note="median over steps")
    ]
    bound = run.median("expert_load_max_over_balanced")
    if bound is not None:
        evidence.append(Evidence("expert_load_max_over_balanced", bound, note="the bound capacity holds"))
    factor = run.setting("train.moe_capacity_factor") or 1.0
    remedies = [
        Remedy(
            ["--aux-loss-coef", _next_aux_coef(run)],
            "spread the tokens, so fewer exceed an expert's capacity",
        ),
        Remedy(["--moe-capacity-factor", f"{factor * 2:g}"], "room for twice the balanced share per expert"),
    ]
    return (
        "the router sends more tokens to a few experts than their capacity holds; dropped slots skip the expert",
        evidence,
        remedies,
    )


def _co_evolution_remedies(run: RunRecord) -> list[Remedy]:
    remedies = []
    pulled = run.setting("algo.use_kl_loss") and (run.setting("algo.kl_loss_coef") or 0) > 0
    if not pulled and not run.setting("co_evolution.magnet_kl_coef"):
        remedies.append(
            Remedy(
                ["--magnet-kl-coef", "0.5"],
                "a KL pull towards each agent's own policy of the last interval (moved with it) keeps both moves "
                "sampled, so the policies cannot run to the deterministic corners they chase each other between "
                "(docs/multi_agent.md)",
            )
        )
    if run.setting("co_evolution.strategy") != "alternating":
        remedies.append(
            Remedy(["--strategy", "alternating"], "one agent learns against fixed opponents at a time")
        )
    if not run.setting("co_evolution.population_size"):
        remedies.append(
            Remedy(
                ["--population-size", "4"],
                "play against past snapshots (fictitious self-play), not only the latest",
            )
        )
    if (run.setting("co_evolution.co_evolution_interval") or 20) < 20:
        remedies.append(
            Remedy(["--co-evolution-interval", "20"], "let each agent adapt before the next switches")
        )
    return remedies


def _frozen(last_half: list[float]) -> bool:
    """The last iterate's exploitability constant over the run's last fifth (the last 40% of the
    last half): the policies sit in a deterministic corner, whatever jumps brought them there."""
    end = last_half[-max(4, (len(last_half) * 2) // 5) :]
    return max(end) - min(end) < 0.01


@check("co_evolution_no_pull", "co-evolution: alternating updates or a population with no KL pull")
def co_evolution_no_pull(run: RunRecord, compare: RunRecord | None):
    """The guide's remedies (alternating, a population) with --magnet-kl-coef 0 and no fixed pull:
    the learner turns deterministic within its phase, measured worse than the symptom they treat."""
    if not run.setting("co_evolution.env_path"):
        return None
    strategy, population = run.setting("co_evolution.strategy"), run.setting("co_evolution.population_size")
    pulled = run.setting("algo.use_kl_loss") and (run.setting("algo.kl_loss_coef") or 0) > 0
    if (strategy != "alternating" and not population) or pulled or run.setting("co_evolution.magnet_kl_coef"):
        return None
    evidence = [
        Evidence("magnet_kl_coef", 0.0, note=f"strategy {strategy}, population {population or 'none'}")
    ]
    last = [
        r["exploitability_avg"] for r in run.steps if isinstance(r.get("exploitability_avg"), (int, float))
    ]
    if last:
        evidence.append(Evidence("exploitability_avg", last[-1], note="the average policy at the end"))
    return (
        "alternating updates and populations need the moving KL reference: without it the learner turns "
        "deterministic within its phase (a policy at P = 1 gets no gradient back), and play ends worse than plain "
        "simultaneous updates",
        evidence,
        [
            Remedy(
                ["--magnet-kl-coef", "0.5"], "the default with these strategies; an explicit 0 turned it off"
            )
        ],
    )


@check("co_evolution_instability", "co-evolution: the agents oscillate, or one dominates")
def co_evolution_instability(run: RunRecord, compare: RunRecord | None):
    steps = run.steps
    tail = steps[len(steps) // 2 :]
    last = [r["exploitability"] for r in tail if isinstance(r.get("exploitability"), (int, float))]
    evidence, causes = [], []
    if len(last) >= 4:
        swing = max(last) - min(last)
        avg = [r["exploitability_avg"] for r in tail if "exploitability_avg" in r]
        end = avg[-1] if avg else last[-1]
        if swing > THRESHOLDS["co_evolution_swing"] and end > THRESHOLDS["co_evolution_exploitability"]:
            evidence.append(
                Evidence(
                    "exploitability",
                    swing,
                    None,
                    THRESHOLDS["co_evolution_swing"],
                    note=f"range over the last half: {min(last):.3g} to {max(last):.3g}",
                )  # fmt: skip
            )
            evidence.append(
                Evidence(
                    "exploitability_avg",
                    end,
                    None,
                    THRESHOLDS["co_evolution_exploitability"],
                    note="at the end",
                )
            )
            causes.append("each agent chases the other's latest policy, so neither settles")
        elif _frozen(last) and last[-1] > THRESHOLDS["co_evolution_stuck"]:
            bets = [v for k, v in tail[-1].items() if k.startswith("bet_") and isinstance(v, (int, float))]
            corner = sum(v < 0.01 or v > 0.99 for v in bets) / len(bets) if bets else None
            note = (
                f"constant over the last fifth; {corner:.0%} of P(bet) at 0 or 1"
                if bets
                else "constant over the last fifth"
            )
            evidence.append(
                Evidence("exploitability", last[-1], None, THRESHOLDS["co_evolution_stuck"], note=note)
            )
            causes.append(
                "the policies went deterministic and stopped exploring: no gradient leaves that corner"
            )
    quarter = steps[-max(2, len(steps) // 4) :]
    for key in sorted({k for r in quarter for k in r if k.startswith("agent_reward_")}):
        values = [r[key] for r in quarter if isinstance(r.get(key), (int, float))]
        if len(values) >= 2 and abs(sum(values) / len(values)) > THRESHOLDS["co_evolution_dominance"]:
            mean = sum(values) / len(values)
            evidence.append(
                Evidence(key, mean, None, THRESHOLDS["co_evolution_dominance"], note="mean, last quarter")
            )
            causes.append(f"{key[len('agent_reward_') :]} {'dominates' if mean > 0 else 'is dominated'}")
    if not evidence:
        return None
    return "; ".join(causes), evidence, _co_evolution_remedies(run)


@check("weight_sync_share", f"weight sync takes more than {THRESHOLDS['sync_share']:.0%} of the step")
def weight_sync_share(run: RunRecord, compare: RunRecord | None):
    shares = [
        r["sync_seconds"] / r["step_time"]
        for r in run.steps
        if r.get("sync_seconds") is not None and r.get("step_time")
    ]
    if not shares:
        return None
    # the lower quartile: a sync slow in three steps of four is the setting; one slow step is load
    share = sorted(shares)[len(shares) // 4]
    if share <= THRESHOLDS["sync_share"]:
        return None
    evidence = [
        Evidence(
            "sync_seconds / step_time",
            share,
            None,
            THRESHOLDS["sync_share"],
            note=f"lower quartile; median sync {run.median('sync_seconds'):.3g} s",
        )
    ]
    remedies = []
    bucket = run.setting("sync.sync_bucket_size", 512 * 1024**2)
    if bucket < 64 * 1024**2:
        remedies.append(
            Remedy(["--sync-bucket-size", str(512 * 1024**2)], f"{bucket} B buckets: fewer, larger copies")
        )
    on_ray = (run.setting("sync.rollout_num_gpus") or 1) > 1 or run.setting(
        "sync.actor_num_gpus_per_node", 1
    ) > 1
    if on_ray and not run.setting("sync.use_zero_copy_sync"):
        remedies.append(Remedy(["--use-zero-copy-sync"], "engines on the trainer's host map its weights"))
    if on_ray and not run.setting("sync.colocate"):
        remedies.append(
            Remedy(["--colocate"], "engines share the trainer's devices: sync without the network")
        )
    if not run.setting("sync.async_weight_sync"):
        remedies.append(Remedy(["--async-weight-sync"], "the sync of step N lands during rollout N+1"))
    return "moving the weights to the engines costs as much as the work", evidence, remedies


def _async(run: RunRecord) -> bool:
    return bool(run.setting("sync.async_weight_sync")) or run.setting("sync.rollout_mode") == "fully-async"


def _weighted_mean(run: RunRecord, metric: str) -> float | None:
    """`metric`'s mean over the run, each step weighted by the samples it trained."""
    pairs = [
        (r[metric], r.get("train_samples", 1)) for r in run.steps if isinstance(r.get(metric), (int, float))
    ]
    weight = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / weight if weight else None


@check("length_drift", "async training sees shorter responses than the engines generate")
def length_drift(run: RunRecord, compare: RunRecord | None):
    generated, trained = (
        _weighted_mean(run, "response_len_generated_mean"),
        _weighted_mean(run, "response_len_mean"),
    )
    if not generated or trained is None or trained >= generated * (1 - THRESHOLDS["length_drift"]):
        return None
    dropped = sum(run.values("stale_dropped"))
    evidence = [
        Evidence("response_len_mean (trained)", trained, note="mean over the run"),
        Evidence(
            "response_len_generated_mean",
            generated,
            threshold=THRESHOLDS["length_drift"],
            note=f"trained {1 - trained / generated:.0%} shorter; {dropped:g} groups dropped as stale",
        ),
    ]
    remedies = []
    if run.setting("sync.drop_stale"):
        remedies.append(
            Remedy(
                ["--rollout-mode", "fully-async"]
                if run.setting("sync.rollout_mode") != "fully-async"
                else [],
                "remove --drop-stale: admission control paces the engines instead, and trains every response",
            )
        )
    remedies.append(
        Remedy(
            ["--max-staleness", str((run.setting("sync.max_staleness") or 1) * 2)],
            "long responses may stay in flight for more versions before they are due",
        )
    )
    return (
        "long responses finish late and are discarded as stale (or still wait at the end)",
        evidence,
        remedies,
    )


@check("async_uncorrected", "an async run trains stale tokens without an off-policy correction")
def async_uncorrected(run: RunRecord, compare: RunRecord | None):
    if not _async(run) or run.setting("algo.use_tis") or run.setting("algo.use_opsm"):
        return None
    stale = run.median("staleness_mean")
    if not stale:
        return None
    evidence = [Evidence("staleness_mean", stale, note="median over steps; no --use-tis, no --use-opsm")]
    remedies = [
        Remedy(
            ["--use-tis"], "weight each token by min(pi_train / pi_rollout, C): the stale part is corrected"
        ),
        Remedy(["--use-tis", "--tis-mode", "mask"], "MIS: mask tokens whose ratio leaves the trust band"),
        Remedy(["--use-opsm"], "mask sequences whose mean log-ratio to the rollout policy is too large"),
    ]
    return "tokens from older weights are trained as if on-policy (a run can collapse)", evidence, remedies


@check("staleness_at_bound", "most trained samples are as stale as --max-staleness allows")
def staleness_at_bound(run: RunRecord, compare: RunRecord | None):
    if run.setting("sync.rollout_mode") != "fully-async":
        return None
    found = _median_over(run, "staleness_at_bound_frac", "staleness_at_bound")
    if found is None:
        return None
    bound = run.setting("sync.max_staleness") or 2
    remedies = [
        Remedy(
            ["--max-staleness", str(bound + 1)], "more versions in flight before a group is due (keep TIS on)"
        ),
        Remedy(
            ["--rollout-num-gpus", str(2 * (run.setting("sync.rollout_num_gpus") or 1))],
            "more engines: the batch is ready sooner",
        ),
    ]
    if run.setting("rollout.over_sampling_batch_size"):
        remedies.append(Remedy([], "a smaller --over-sampling-batch-size: fewer groups wait in flight"))
    return (
        "the pacing binds: the trainer keeps waiting for groups at their deadline, so the engines set the pace",
        found,
        remedies,
    )


@check("vision_blind", "the vision-language model does not look at its images")
def vision_blind(run: RunRecord, compare: RunRecord | None):
    change = run.median("vision_logprob_change")
    if change is None or change > THRESHOLDS["vision_change"]:
        return None
    evidence = [
        Evidence(
            "vision_logprob_change", change, threshold=THRESHOLDS["vision_change"],
            note="median over steps: blanking the images moves the response log-probs by this much",
        )
    ]  # fmt: skip
    remedies = []
    if run.setting("debug.debug_blank_images"):
        remedies.append(Remedy([], "remove --debug-blank-images: every image is replaced by a white one"))
    remedies += [
        Remedy(
            [],
            "check that each prompt's token ids and pixels come from one processor call (--multimodal-keys)",
        ),
        Remedy(
            ["--lr", f"{(run.setting('train.lr') or 1e-6) * 2:g}"],
            "a base that ignores the images may need a larger step to start using them",
        ),
    ]
    return (
        "the images do not reach the model, or it learnt to ignore them: it trains as a text-only model",
        evidence,
        remedies,
    )


@check("images_dropped", "images missing after the first turn of a conversation")
def images_dropped(run: RunRecord, compare: RunRecord | None):
    share = run.median("image_turns_dropped_frac")
    if not share:
        return None
    evidence = [
        Evidence(
            "image_turns_dropped_frac", share, threshold=0.0,
            note="median over steps: conversations where a later turn's request carried fewer images than an earlier one",
        )
    ]  # fmt: skip
    remedies = [
        Remedy(
            [],
            "send every turn the whole conversation's ids and images: client.generate(ids, params, "
            "images=join_images(prompt_images, turn_images)) (miles.data.images.join_images)",
        )
    ]
    return (
        "later turns are generated without the images of earlier ones: the model answers them blind",
        evidence,
        remedies,
    )


@check("memory_growth", "per-step peak memory keeps growing")
def memory_growth(run: RunRecord, compare: RunRecord | None):
    keys = sorted({k for r in run.steps for k in r if k.startswith("mem_") and k.endswith("_gb")})
    for key in keys:
        values = [v for v in run.values(key) if math.isfinite(v)][1:]  # step 0 warms up
        if len(values) < 4:
            continue
        half = len(values) // 2
        start, end = min(values[:2]), min(values[-2:])
        growth = end - start
        rising = sum(values[half:]) / (len(values) - half) > sum(values[:half]) / half
        # a leak keeps growing; a working set that grows to its size (larger batches as a run
        # goes, freed memory kept in the heap) and then stays is not one
        still = end - min(values[half : half + 2]) > growth / 4
        if (
            rising
            and still
            and growth > THRESHOLDS["memory_growth_gb"]
            and growth > THRESHOLDS["memory_growth_frac"] * start
        ):
            evidence = [
                Evidence(
                    key,
                    end,
                    run.series(key)[-1][0],
                    note=f"from {start:.3g} GB after warm-up: +{growth:.3g} GB",
                )
            ]
            remedies = [
                Remedy(
                    ["--debug-rollout-only"],
                    "rollouts only: growth that remains is on the rollout side (engine, rewards, filters, data)",
                ),
                Remedy(
                    [],
                    "code plugged in (--custom-rm-path, --dynamic-sampling-filter-path) that keeps references across steps",
                ),
            ]
            return "something keeps memory from step to step (a leak)", evidence, remedies
    return None


# ---- speculative rollout ------------------------------------------------------------------------


def _draft_training_remedies(run: RunRecord) -> list[Remedy]:
    if run.setting("speculative.draft_model") == "ngram":
        return [
            Remedy(
                ["--draft-model", "eagle", "--online-sft-interval", "5"],
                "a head over the policy's own hidden states, trained on its rollouts",
            )
        ]
    if not run.setting("speculative.online_sft_interval"):
        return [
            Remedy(["--online-sft-interval", "5"], "train the draft on the latest rollouts every 5 steps")
        ]
    lr = run.setting("speculative.draft_lr", 1e-3)
    return [
        Remedy(
            ["--draft-lr", f"{lr * 3:g}"],
            f"three times this run's --draft-lr {lr:g}: the draft keeps up faster",
        )
    ]


@check(
    "spec_low_acceptance",
    f"speculative decoding: the policy accepts under {THRESHOLDS['spec_accept']:.0%} of proposals",
)
def spec_low_acceptance(run: RunRecord, compare: RunRecord | None):
    rate = run.median("spec_accept_rate")
    if rate is None or rate >= THRESHOLDS["spec_accept"]:
        return None
    evidence = [Evidence("spec_accept_rate", rate, None, THRESHOLDS["spec_accept"], note="median over steps")]
    remedies = _draft_training_remedies(run)
    if run.setting("speculative.draft_model") == "eagle" and not run.setting("speculative.eagle_head"):
        remedies.append(
            Remedy(
                [],
                "start from a trained head: `miles draft --config <this run's config.yaml> --out head.pt`, then "
                "--eagle-head head.pt (an untrained head needs tens of thousands of tokens to predict well)",
            )
        )
    k = run.setting("speculative.spec_lookahead", 5)
    if k > 3:
        remedies.append(
            Remedy(
                ["--spec-lookahead", "3"], f"shorter proposals than {k}: late positions are rarely reached"
            )
        )
    return "the draft predicts the policy poorly", evidence, remedies


@check("spec_drift", "speculative decoding: acceptance falls as the policy trains")
def spec_drift(run: RunRecord, compare: RunRecord | None):
    values = [v for v in run.values("spec_accept_rate") if math.isfinite(v)]
    if len(values) < 10:
        return None
    window = max(2, len(values) // 5)
    start, end = sum(values[:window]) / window, sum(values[-window:]) / window
    if start - end <= THRESHOLDS["spec_drift"]:
        return None
    evidence = [
        Evidence(
            "spec_accept_rate",
            end,
            None,
            note=f"mean of the last {window} steps, from {start:.3g} in the first {window}",
        )
    ]
    remedies = _draft_training_remedies(run)
    if run.setting("speculative.online_sft_interval"):
        if run.setting("speculative.draft_ema_decay") is None:
            remedies.append(Remedy(["--draft-ema-decay", "0.99"], "serve an average of the draft: steadier"))
        if not run.setting("speculative.reinit_draft_interval"):
            every = 1000 if len(values) >= 2000 else max(10, len(values) // 2)
            remedies.append(
                Remedy(
                    ["--reinit-draft-interval", str(every)], "rebuild the draft from the policy now and then"
                )
            )
    return "the policy moved away from the draft", evidence, remedies


@check("spec_slow", "speculative decoding costs more than the tokens it saves")
def spec_slow(run: RunRecord, compare: RunRecord | None):
    draft, verify = run.median("spec_draft_seconds"), run.median("spec_verify_seconds")
    per_pass = run.median("spec_tokens_per_pass")
    if draft is None or verify is None or per_pass is None or verify <= 0:
        return None
    estimate = per_pass / (1 + draft / verify)  # a verify pass costs about one plain decoding step
    if estimate >= 1.0:
        return None
    evidence = [
        Evidence("spec_tokens_per_pass", per_pass, note="median"),
        Evidence(
            "spec_draft_seconds",
            draft,
            note=f"median; verify {verify:.3g} s: estimated speedup {estimate:.2f}x",
        ),
    ]
    remedies = []
    k = run.setting("speculative.spec_lookahead", 5)
    if k != 5:
        remedies.append(
            Remedy(["--spec-lookahead", "5"], "the usual balance of draft cost and accepted length")
        )
    draft = run.setting("speculative.draft_model")
    if draft not in ("ngram", "eagle"):
        remedies.append(
            Remedy(
                ["--draft-model", "eagle", "--online-sft-interval", "5"],
                "one small block over the policy's hidden state, reading the policy's own lm_head",
            )
        )
    if draft != "ngram":
        remedies.append(Remedy(["--draft-model", "ngram"], "a draft that costs almost nothing to run"))
    if not run.setting("speculative.profile_speculative"):
        remedies.append(
            Remedy(
                ["--profile-speculative"], "a table per step: acceptance by position, costs, best lookahead"
            )
        )
    return (
        "the draft is too slow for what it predicts (aim at 1/10 to 1/4 of the policy's size)",
        evidence,
        remedies,
    )


# ---- against another run -----------------------------------------------------------------------

IGNORED_SETTINGS = {
    "output_dir",
    "save",
    "load",
    "resume_if_present",
    "progress",
    "log_level",
    "use_wandb",
    "use_tensorboard",
}


def _final_accuracy(run: RunRecord, upto: int) -> float | None:
    """Mean of the last two evaluations at or before step `upto`."""
    evals = [v for step, v in run.evals() if step <= upto]
    return sum(evals[-2:]) / len(evals[-2:]) if evals else None


def _as_flag(key: str, value) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + key.replace("_", "-")]
    return [flag, str(value)]


@check("accuracy_gap", "held-out accuracy trails the --compare run")
def accuracy_gap(run: RunRecord, compare: RunRecord | None):
    if compare is None:
        return None
    # compared over the steps both runs reached: a longer reference run is not a gap
    upto = min(max((s for s, _ in r.evals()), default=-1) for r in (run, compare))
    mine, theirs = _final_accuracy(run, upto), _final_accuracy(compare, upto)
    if mine is None or theirs is None or theirs - mine <= THRESHOLDS["accuracy_gap"]:
        return None
    evidence = [
        Evidence("eval_accuracy", mine, note=f"mean of the last two evaluations up to step {upto}"),
        Evidence(
            "eval_accuracy (--compare)", theirs, threshold=THRESHOLDS["accuracy_gap"], note=str(compare.path)
        ),
    ]
    remedies = []
    for section, values in compare.config.items():
        for key, value in (values or {}).items():
            if key in IGNORED_SETTINGS or run.setting(f"{section}.{key}") == value or value is None:
                continue
            if isinstance(value, (dict, list)):
                continue
            remedies.append(
                Remedy(
                    _as_flag(key, value),
                    f"the --compare run's {key} (this run: {run.setting(f'{section}.{key}')})",
                )
            )
    if run.setting("precision.fp8_rollout_only") and not run.setting("algo.use_tis"):
        remedies.append(Remedy(["--use-tis"], "correct the FP8 rollout's mismatch"))
    known = {tuple(r.flags) for r in remedies}
    remedies += [r for r in _fp8_remedies(run) + _int4_remedies(run, True) if tuple(r.flags) not in known]
    return "the runs differ in the settings below; each is a candidate", evidence, remedies
