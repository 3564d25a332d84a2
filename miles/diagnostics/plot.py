"""`miles plot RUN_DIR`: PNG curves of the metrics people look at first."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from miles.diagnostics.metrics_file import read_metrics
from miles.errors import MilesError

PANELS = [
    ("reward", ["reward_mean"]),
    ("accuracy", ["accuracy", "eval_accuracy"]),
    ("eval_sets", ["eval_*_accuracy"]),  # each --eval-config set's accuracy
    ("pass_at_k", ["eval_pass@*", "eval_*_pass@*"]),  # --n-samples-per-eval-prompt > 1, a set's n_samples > 1
    ("kl", ["ppo_kl", "kl_loss", "kl_rollout_train_k3"]),
    ("logprob_mismatch", ["train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max"]),
    ("routing_mismatch", ["routing_mismatch_frac", "routing_mismatch_token_frac"]),
    (
        "time",
        ["rollout_time", "train_time", "sync_seconds", "engine_prefill_time", "engine_decode_time"],
    ),  # seconds per step (train_time includes the sync; engine_*: the engines' own split)
    ("lengths", ["response_len_mean", "observation_tokens_mean"]),  # observation: tool results (agents)
    (
        "memory",
        ["mem_driver_peak_rss_gb", "mem_train_peak_rss_gb", "mem_rollout_peak_rss_gb"],
    ),  # per-step peak GB
    ("loss", ["pg_loss", "entropy"]),
    ("overlong", ["overlong_penalty_mean", "overlong_frac"]),  # --overlong-buffer-len
    ("preference", ["rewards/chosen", "rewards/rejected", "rewards/margins"]),  # miles dpo
    ("preference_accuracy", ["rewards/accuracies", "eval_pairwise_accuracy"]),  # miles dpo, miles rm
    ("tis", ["tis_clipfrac", "pg_clipfrac"]),
    ("fp8", ["fp8_flush_frac", "fp8_saturation_frac", "fp8_enabled", "int4_enabled"]),  # FP8 / INT4
    (
        "model_memory",
        [
            "mem_train_weights_gb",
            "mem_train_grads_gb",
            "mem_train_optimizer_gb",
            "mem_rollout_weights_float32_gb",
            "mem_rollout_weights_bfloat16_gb",
            "mem_rollout_weights_float8_e4m3fn_gb",
            "mem_rollout_weights_uint8_gb",
        ],
    ),  # GB held for the policy: a training rank's weights/grads/optimizer, an engine's weights by dtype
    ("critic", ["value_loss", "explained_variance"]),  # PPO
    ("speculative", ["spec_accept_rate", "spec_tokens_per_pass", "draft_sft_loss"]),  # --draft-model
    # MoE: a collapsed router shows as a high max/mean load, idle experts and a falling entropy
    ("expert_load", ["expert_load_max_over_mean", "expert_layer_load_max_over_mean"]),
    ("expert_usage", ["expert_idle_frac", "expert_dropped_frac"]),
    ("router", ["router_entropy", "aux_loss"]),
    ("expert_share", ["expert_share_e*"]),  # each expert's share of the kept slots
    ("r3_buffer", ["r3_buffer_peak_mb"]),  # --r3-buffer-size
    # tool-calling rollouts (--tool-path, --agent-path): calls, errors by kind, cut conversations
    ("tools", ["turns_mean", "tool_calls_mean", "tool_error_frac", "tool_seconds"]),
    ("tool_errors", ["tool_errors_*"]),
    (
        "trajectories",
        ["trajectory_truncated_frac", "trajectory_max_turns_frac", "trajectory_budget_frac", "agent_errors"],
    ),
    # co-evolution (--env-path): each agent's reward, and Kuhn Poker's exact exploitability
    ("agent_reward", ["agent_reward_*"]),
    ("exploitability", ["exploitability", "exploitability_avg", "game_value"]),
    ("kuhn_policy", ["bet_*"]),  # P(bet) at each information set
    ("win_rate", ["win_rate_*"]),  # each agent's, and against each population member by age
    # proposer/solver: the solver's held-out accuracy and how much of what the proposer writes it can learn from
    (
        "proposer_solver",
        ["solver_eval_accuracy", "learnable_share", "valid_share", "solver_pass_rate", "distinct_share"],
    ),
    # the proposer's problems getting harder as the solver improves
    ("proposer_curriculum", ["problem_digits"]),
]


def panel_keys(keys: list[str], records: list[dict]) -> list[str]:
    """The panel's metric names, a * standing for any run of characters (e.g. every expert's
    share, every evaluation set's accuracy)."""
    out: list[str] = []
    for key in keys:
        if "*" in key:
            names = {k for r in records for k in r if fnmatch.fnmatchcase(k, key)}
            out += sorted(names, key=lambda k: (len(k), k))
        else:
            out.append(key)
    return out


PAYOFF = re.compile(r"win_rate_(.+)_vs_(.+)_age(\d+)$")


def payoff_table(records: list[dict]) -> dict[str, dict[int, float]]:
    """--population-size: each learner's mean win rate against each opponent's snapshot by age
    (0: the newest), over the run's second half: {"learner vs opponent": {age: win rate}}."""
    sums: dict[str, dict[int, list[float]]] = {}
    steps = [r for r in records if r["rollout"] >= 0]
    for record in steps[len(steps) // 2 :]:
        for key, value in record.items():
            if (match := PAYOFF.match(key)) and isinstance(value, (int, float)):
                row = sums.setdefault(f"{match[1]} vs {match[2]}", {})
                row.setdefault(int(match[3]), []).append(float(value))
    return {
        row: {age: sum(v) / len(v) for age, v in sorted(ages.items())} for row, ages in sorted(sums.items())
    }


def plot_payoffs(table: dict[str, dict[int, float]], path: Path) -> None:
    """The payoff table as a heat map: a row per learner and opponent, a column per snapshot age."""
    import matplotlib.pyplot as plt

    ages = sorted({age for row in table.values() for age in row})
    fig, ax = plt.subplots(figsize=(1.6 + 0.9 * len(ages), 0.8 + 0.6 * len(table)))
    cells = [[row.get(age, float("nan")) for age in ages] for row in table.values()]
    ax.imshow(cells, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, line in enumerate(cells):
        for j, value in enumerate(line):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(ages)), [f"age {a}" for a in ages])
    ax.set_yticks(range(len(table)), list(table))
    ax.set_title("population payoffs: win rate, second half")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_run(run_dir: str | Path, compare: str | Path | None = None) -> list[Path]:
    """Each panel's curves of RUN_DIR into RUN_DIR/plots; `compare`: another run's, dashed, on
    the same axes (a baseline, the run before a change)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise MilesError(f"{run_dir}: no metrics.jsonl here; give the run directory that miles train printed")
    records = read_metrics(run_dir)
    other = None
    if compare is not None:
        if not (Path(compare) / "metrics.jsonl").exists():
            raise MilesError(f"--compare {compare}: no metrics.jsonl here; give another run directory")
        other = read_metrics(compare)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, keys in PANELS:
        series = {
            k: [(r["rollout"], r[k]) for r in records if isinstance(r.get(k), (int, float))]
            for k in panel_keys(keys, records)
        }
        series = {k: v for k, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for k, points in series.items():
            xs, ys = zip(*points)
            line = ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=k)[0]
            theirs = [(r["rollout"], r[k]) for r in other or [] if isinstance(r.get(k), (int, float))]
            if theirs:
                xs, ys = zip(*theirs)
                ax.plot(xs, ys, "--", color=line.get_color(), label=f"{k} ({Path(compare).name})")
        ax.set_xlabel("rollout")
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if table := payoff_table(records):
        plot_payoffs(table, out_dir / "population_payoff.png")
        written.append(out_dir / "population_payoff.png")
    return written
