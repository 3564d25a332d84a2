"""The `miles` command: one sub-command per job (see `miles --help`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from miles.config.loader import add_field_flags, retired_message
from miles.data.prompts import DEFAULT_JOB
from miles.errors import MilesError


def number(kind: type, low: float, low_open: bool = False):
    """An argparse type: `kind` (int or float) of at least `low` (above it, with `low_open`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value < low or (low_open and value == low) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {low}, got {text}")
        return value

    return parse


# spellings `miles generate` and `miles serve` took before they shared miles train's flags
RETIRED_FLAGS = {
    "--fused-step": "--rollout-decode-step fused (or auto, the default)",
    "--no-fused-step": "--rollout-decode-step general",
    "--seed": "--rollout-seed (the engine's sampling seed, as in miles train)",
}


def parse_command(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse a sub-command's flags; a retired spelling is refused naming its replacement."""
    for token in argv if argv[:1] in (["generate"], ["serve"]) else []:
        flag = token.split("=", 1)[0]
        if flag in RETIRED_FLAGS:
            raise MilesError(f"{flag} is no longer a flag: use {RETIRED_FLAGS[flag]}")
        if flag.startswith("--") and (message := retired_message(flag[2:])):  # miles train's retired flags
            raise MilesError(message)
    return parser.parse_args(argv)


def engine_config(args: argparse.Namespace, **same_as: str):
    """The validated run configuration of a serve/generate command's shared flags; `same_as`:
    field -> the field whose value it takes."""
    from miles.config.loader import field_values, make_config

    values = field_values(args)
    return make_config({**values, **{name: values[source] for name, source in same_as.items()}})


def cmd_generate(args: argparse.Namespace) -> int:
    from miles.models import registry
    from miles.models.tokenizer import encode_prompt
    from miles.rollout import Engine, Request, SamplingParams
    from miles.rollout.kv_budget import check_weights_fit

    cfg = engine_config(args)
    rollout = cfg.rollout
    check_weights_fit(cfg.model.model, registry.config_for(cfg.model.model))
    model, tokenizer = registry.load(cfg.model.model)
    prompt_ids = encode_prompt(tokenizer, args.prompt, args.chat)
    new_tokens = rollout.rollout_max_response_len
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=1,
        max_seq_len=len(prompt_ids) + new_tokens + 1,
        **rollout.engine_options(),
    )
    params = SamplingParams(
        temperature=rollout.rollout_temperature, max_new_tokens=new_tokens, seed=rollout.rollout_seed
    )
    sample = engine.generate([Request(list(prompt_ids), params)])[0]
    print(sample.response if args.chat else args.prompt + sample.response)
    return 0


def serve_until_stopped(args: argparse.Namespace, make_server, describe) -> int:
    """Start the server `make_server` builds and serve until Ctrl-C; a port that cannot be
    listened on is a clear error."""
    import time

    try:
        server = make_server().start()
    except OSError as e:
        raise MilesError(
            f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e}); is another server on "
            "that port? Pick another --port (0: any free one)"
        ) from e
    print(f"miles serve: {describe(server.url)}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0


def serve_reward_model(args: argparse.Namespace, path: str) -> int:
    """`miles serve --model DIR` where DIR holds a reward model: POST /reward answers scores."""
    from miles.models.registry import tokenizer_for
    from miles.rewards.reward_model import load_reward_model
    from miles.serve.reward_server import RewardServer

    model = load_reward_model(path, "--model")
    return serve_until_stopped(
        args,
        lambda: RewardServer(model, tokenizer_for(path), args.host, args.port),
        lambda url: (
            f"reward model {path} on {url} (POST /reward, GET /health); use it with --rm-type remote_rm "
            f"--rm-url {url}/reward"
        ),
    )


def cmd_serve(args: argparse.Namespace) -> int:

    from miles.models import registry
    from miles.rewards.reward_model import is_reward_model
    from miles.rollout.drafts import speculator_for
    from miles.rollout.engine import Engine
    from miles.rollout.kv_budget import check_weights_fit
    from miles.serve.server import EngineServer

    if not 0 <= args.port <= 65535:
        raise MilesError(f"--port {args.port}: a TCP port is 0-65535 (0: any free port)")
    cfg = engine_config(args, spec_max_batch_size="rollout_max_batch_size")
    if cfg.speculative.draft_model == "eagle" and not cfg.speculative.eagle_head:
        raise MilesError(
            "miles serve --draft-model eagle: an EAGLE head starts untrained and learns during miles train "
            "(--online-sft-interval); serve one trained by miles draft (--eagle-head FILE), or --draft-model ngram, auto "
            "or a draft checkpoint path"
        )
    if is_reward_model(cfg.model.model):  # miles rm's checkpoint: scores for --rm-type remote_rm
        return serve_reward_model(args, cfg.model.model)
    check_weights_fit(cfg.model.model, registry.config_for(cfg.model.model))
    model, tokenizer = registry.load(cfg.model.model)
    context = model.config.max_position_embeddings
    if args.max_seq_len is not None and args.max_seq_len > context:
        print(f"miles serve: --max-seq-len {args.max_seq_len} is beyond the model's context; using {context}")
    max_seq_len = min(args.max_seq_len or context, context)
    slots = cfg.rollout.rollout_max_batch_size
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=slots,
        max_seq_len=max_seq_len,
        seed=cfg.rollout.rollout_seed,
        speculator=speculator_for(cfg.speculative, model, slots, max_seq_len),
        **cfg.rollout.engine_options(),
    )
    return serve_until_stopped(
        args,
        lambda: EngineServer(engine, host=args.host, port=args.port, model_path=cfg.model.model),
        lambda url: f"{cfg.model.model} on {url} (POST /generate, GET /health)",
    )


def default_job_argv(rest: list[str]) -> list[str]:
    """`miles train` alone runs the embedded default job; flags that name no job of their own
    (no --config, --task or --prompt-data) change that job, e.g. `miles train --colocate`."""
    own_job = ("--config", "--task", "--prompt-data")
    if (
        any(a == flag or a.startswith(flag + "=") for a in rest for flag in own_job)
        or "--help" in rest
        or "-h" in rest
    ):
        return rest
    return ["--config", str(DEFAULT_JOB), *rest]


def cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    import logging

    from miles.config import describe, load_config
    from miles.logs import setup_logging
    from miles.run import train

    argv = default_job_argv(rest)
    if argv is not rest:
        what = "no arguments" if not rest else "no --config, --task or --prompt-data"
        print(
            f"miles train: {what}: running the embedded default job ({DEFAULT_JOB.name})"
            + (" with your flags on top" if rest else "")
            + "; see miles train --help"
        )
    cfg = load_config(argv)
    log = setup_logging(cfg.logging.log_level)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("resolved configuration (defaults < YAML < flags):\n%s", describe(cfg))
    run_dir = train(cfg)
    print(f"miles train: done; metrics in {run_dir / 'metrics.jsonl'} (plot them: miles plot {run_dir})")
    return 0


def cmd_eval(args: argparse.Namespace, rest: list[str]) -> int:
    """Evaluate a checkpoint (--load) or a model (--model) on the run's evaluation sets."""
    import json

    from miles.config import load_config
    from miles.runtime.eval_only import evaluate_checkpoint

    if "--help" in rest or "-h" in rest:
        print(
            "usage: miles eval [--config FILE] [--load CHECKPOINT_DIR | --model MODEL] [miles train flags]\n\n"
            "Evaluate a checkpoint of a run, or a model, on the run's evaluation sets (its held-out set with "
            "--n-samples-per-eval-prompt / --eval-temperature, and --eval-config's named sets) with the engine "
            "the run would build; prints one JSON object of eval_* metrics (and writes it to "
            "--output-dir/eval.json when given). Every other flag is miles train's: see miles train --help."
        )
        return 0
    cfg = load_config(default_job_argv(rest))
    metrics = evaluate_checkpoint(cfg)
    print(json.dumps(metrics, indent=1))
    if cfg.logging.output_dir:
        out = Path(cfg.logging.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return 0


def cmd_draft(args: argparse.Namespace, rest: list[str]) -> int:
    """Train an EAGLE head on the policy's samples of the run's prompts (see --help)."""
    import json

    from miles.config import load_config
    from miles.runtime.draft_pretrain import pretrain_eagle

    own = argparse.ArgumentParser(prog="miles draft", add_help=False)
    own.add_argument("--out", type=Path)
    own.add_argument("--draft-prompts", type=number(int, 2), default=256)
    own.add_argument("--draft-epochs", type=number(int, 1), default=4)
    args, rest = own.parse_known_args(rest)
    if "--help" in rest or "-h" in rest:
        print(
            "usage: miles draft --out FILE [--draft-prompts N] [--draft-epochs N] [--config FILE] [miles train "
            "flags]\n\nTrain an EAGLE draft head before a run: sample N of the run's prompts (default 256) as "
            "its rollouts would, train the head --draft-epochs passes (default 4) on the policy's own tokens and "
            "hidden states, save it to --out and print its held-out acceptance by draft position. Start a run with it: "
            "--draft-model eagle --eagle-head FILE. Every other flag is miles train's: see miles train --help."
        )
        return 0
    if args.out is None:
        raise MilesError("miles draft needs --out FILE: where to save the trained head")
    cfg = load_config(default_job_argv(rest))
    metrics = pretrain_eagle(cfg, args.out, args.draft_prompts, args.draft_epochs)
    print(json.dumps(metrics, indent=1))
    print(f"miles draft: head saved to {args.out}; use it with --draft-model eagle --eagle-head {args.out}")
    return 0


SFT_LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules")  # `miles train`'s flags, in `miles sft`


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it (the config fields' flags do)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_pair_flags(
    parser: argparse.ArgumentParser, steps: int, lr: float, eval_every: int, output_dir: str
) -> None:
    """The flags `miles dpo` and `miles rm` share: the model, the pairs, the loop, where results go."""
    parser.add_argument("--model", default="tiny", help="model to start from")
    parser.add_argument(
        "--task", default="basic_arithmetic", help="reasoning-gym task the pairs are built from"
    )
    parser.add_argument(
        "--task-config", help="JSON keyword arguments for the task (default: the default job's)"
    )
    parser.add_argument(
        "--data", help="JSONL or Parquet file of pairs: prompt, chosen, rejected (replaces --task)"
    )
    parser.add_argument("--no-chat", action="store_true", help="prompts as raw text, no chat template")
    parser.add_argument("--steps", type=number(int, 1), default=steps, help="optimizer steps")
    parser.add_argument("--batch-size", type=number(int, 1), default=16, help="pairs per step")
    parser.add_argument("--lr", type=number(float, 0, low_open=True), default=lr, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pairs and their order")
    parser.add_argument(
        "--eval-every", type=number(int, 1), default=eval_every, help="steps between held-out evaluations"
    )
    parser.add_argument(
        "--eval-size", type=number(int, 0), default=200, help="held-out problems or pairs (0: none)"
    )
    parser.add_argument(
        "--output-dir", default=output_dir, help="where metrics.jsonl goes (miles plot reads it)"
    )
    parser.add_argument(
        "--save", help="write the model here (an HF checkpoint; with --lora-rank the PEFT adapter)"
    )


def pair_values(args: argparse.Namespace) -> dict:
    """`add_pair_flags`' values as the configs of `miles dpo` and `miles rm` name them."""
    import json

    try:
        task_config = json.loads(args.task_config) if args.task_config else None
    except json.JSONDecodeError as e:
        raise MilesError(f"--task-config is not valid JSON: {e}") from e
    return dict(
        model=args.model, task=None if args.data else args.task, task_config=task_config, data=args.data,
        chat=not args.no_chat, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        eval_every=args.eval_every, eval_size=args.eval_size, output_dir=args.output_dir, save=args.save,
    )  # fmt: skip


def cmd_dpo(args: argparse.Namespace) -> int:
    from miles.config.loader import field_values
    from miles.train.dpo import DPOConfig, run_dpo

    cfg = DPOConfig(
        **pair_values(args),
        beta=args.beta,
        loss_type=args.loss_type,
        length_normalize=args.length_normalize,
        **field_values(args, names=SFT_LORA_FIELDS),
    )
    result = run_dpo(cfg)
    print(
        f"miles dpo: {result['steps']} steps, loss {result['loss']:.4f}, held-out accuracy "
        f"{result['eval_accuracy']:.3f}; metrics in {result['run_dir']}/metrics.jsonl"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from miles.train.reward_training import RMConfig, run_rm

    result = run_rm(RMConfig(**pair_values(args)))
    print(
        f"miles rm: {result['steps']} steps, loss {result['loss']:.4f}, held-out pairwise accuracy "
        f"{result['eval_pairwise_accuracy']:.3f}; metrics in {result['run_dir']}/metrics.jsonl"
        + (f"; score rollouts with --rm-type model --rm-path {args.save}" if args.save else "")
    )
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    import json

    from miles.config.loader import field_values
    from miles.train.sft import SFTConfig, run_sft

    if args.save and Path(args.save).exists() and not Path(args.save).is_dir():
        raise MilesError(f"--save {args.save}: is a file; give a directory (it is created when missing)")
    try:
        task_config = json.loads(args.task_config) if args.task_config else None
    except json.JSONDecodeError as e:
        raise MilesError(f"--task-config is not valid JSON: {e}") from e
    cfg = SFTConfig(
        model=args.model, task=args.task, task_config=task_config, data=args.data, input_key=args.input_key,
        label_key=args.label_key, chat=not args.no_chat, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        seed=args.seed, eval_every=args.eval_every, target_accuracy=args.target_accuracy, save=args.save, log=args.log,
        eval_size=args.eval_size, **field_values(args, names=SFT_LORA_FIELDS),
    )  # fmt: skip
    result = run_sft(cfg)
    print(
        f"miles sft: {result['steps']} steps, loss {result['loss']:.4f}, held-out accuracy {result['eval_accuracy']:.3f}"
    )
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from miles.diagnostics.plot import plot_run

    for path in plot_run(args.run_dir, args.compare):
        print(path)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import json

    if args.env:
        from miles.doctor.env import environment, format_env

        report = environment(args.model)
        print(json.dumps(report, indent=2, default=str) if args.json else format_env(report))
        return 0
    if args.localize_mismatch:
        from miles.diagnostics.localize import format_localization, localize
        from miles.doctor import load_run

        step = load_run(args.localize_mismatch).setting("rollout.rollout_decode_step", "auto")
        result = localize(args.localize_mismatch, args.tolerance)
        print(
            json.dumps(dataclasses.asdict(result), indent=2)
            if args.json
            else format_localization(result, step)
        )
        return 1 if result.diverged else 0
    if args.run_dir is None:
        raise MilesError("give a run directory (miles doctor RUN_DIR), --localize-mismatch RUN_DIR or --env")
    from miles.doctor import diagnose, load_run
    from miles.doctor.report import format_json, format_text

    run = load_run(args.run_dir)
    compare = load_run(args.compare) if args.compare else None
    findings = diagnose(run, compare)
    print((format_json if args.json else format_text)(run, findings, compare))
    return 1 if findings else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles",
        description="miles: RL post-training for LLMs (GRPO/PPO with verifiable rewards), CPU to GPU cluster.",
    )
    from miles import __version__

    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with the rollout engine",
        description="Print the continuation of --prompt by --model (greedy unless --temperature > 0).",
    )
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn"
    )
    add_field_flags(
        gen,
        ["model", "rollout_max_response_len", "rollout_temperature", "rollout_seed", "rollout_decode_step"]
        + ["mem_fraction_static"],
        rollout_max_response_len=32,
        rollout_temperature=0.0,
    )
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser(
        "serve",
        help="serve the rollout engine over HTTP (SGLang-compatible /generate)",
        description="Run the rollout engine behind HTTP: POST /generate (text or input_ids, sampling_params, "
        "return_logprob, return_routed_experts), GET /health, POST /flush_cache, GET /get_model_info, "
        "POST /update_weights_from_disk. See docs/rollout.md.",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=number(int, 0), default=30000, help="port (default 30000, SGLang's)")
    serve.add_argument(
        "--max-seq-len",
        type=number(int, 2),
        default=None,
        help="prompt + response tokens per request (default and at most: the model's context)",
    )
    add_field_flags(
        serve,
        ["model", "rollout_max_batch_size", "rollout_seed", "rollout_decode_step", "mem_fraction_static"]
        + ["draft_model", "draft_layers", "eagle_head", "spec_lookahead"],
        rollout_max_batch_size=64,
    )
    serve.set_defaults(func=cmd_serve)

    sub.add_parser(
        "train",
        help="RL post-training (GRPO); no arguments = the embedded default job",
        description="RL post-training. All flags: miles train --help",
        add_help=False,
    )

    sub.add_parser(
        "draft",
        help="train an EAGLE draft head on the policy's own samples, to start speculative rollout from",
        description="Train a speculative draft head before a run. Flags: miles draft --help",
        add_help=False,
    )

    sub.add_parser(
        "eval",
        help="evaluate a checkpoint (--load) or a model on the run's evaluation sets, pass@k included",
        description="Evaluation alone. Flags: miles eval --help",
        add_help=False,
    )

    dpo = sub.add_parser(
        "dpo",
        help="direct preference optimisation on (prompt, chosen, rejected) pairs",
        description="DPO (or IPO) on preference pairs: a JSONL/Parquet file with TRL's columns prompt, chosen, "
        "rejected, or pairs built from a reasoning-gym task (its answer chosen, a wrong number rejected). The "
        "reference is the starting policy (with LoRA: its base). See docs/preference.md.",
        formatter_class=DefaultsOnce,
    )
    add_pair_flags(dpo, steps=200, lr=1e-4, eval_every=50, output_dir="runs/dpo")
    dpo.add_argument("--beta", type=number(float, 0, low_open=True), default=0.1, help="the KL strength beta")
    dpo.add_argument(
        "--loss-type", choices=("sigmoid", "ipo"), default="sigmoid", help="sigmoid: DPO; ipo: IPO"
    )
    dpo.add_argument(
        "--length-normalize", action="store_true", help="average each response's log-probs over its tokens"
    )
    add_field_flags(dpo, list(SFT_LORA_FIELDS))
    dpo.set_defaults(func=cmd_dpo)

    rm = sub.add_parser(
        "rm",
        help="train a Bradley-Terry reward model on preference pairs",
        description="A reward model (the policy's network with a scalar head) trained on (prompt, chosen, "
        "rejected) pairs: a JSONL/Parquet file with TRL's columns, or pairs built from a task. Saved as an HF "
        "checkpoint that miles train scores rollouts with (--rm-type model --rm-path DIR). See docs/preference.md.",
        formatter_class=DefaultsOnce,
    )
    add_pair_flags(rm, steps=600, lr=1e-3, eval_every=100, output_dir="runs/rm")
    rm.set_defaults(func=cmd_rm)

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on a task or a JSONL file",
        description="Supervised fine-tuning: cross-entropy on the answer tokens (answer + EOS).",
        formatter_class=DefaultsOnce,
    )
    sft.add_argument("--model", default="tiny-random", help="model to start from (default: tiny-random)")
    sft.add_argument("--task", help="reasoning-gym task, e.g. basic_arithmetic")
    sft.add_argument("--task-config", help="JSON keyword arguments for the task, e.g. '{\"max_digits\": 2}'")
    sft.add_argument("--data", help="JSONL or Parquet file of prompts and answers")
    sft.add_argument("--input-key", default="input", help="prompt field of --data")
    sft.add_argument("--label-key", default="label", help="answer field of --data")
    sft.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    sft.add_argument("--steps", type=number(int, 1), default=1000, help="optimizer steps")
    sft.add_argument("--batch-size", type=number(int, 1), default=64, help="examples per step")
    sft.add_argument("--lr", type=number(float, 0, low_open=True), default=1e-3, help="AdamW learning rate")
    sft.add_argument("--seed", type=int, default=0, help="seed for init and data order")
    sft.add_argument(
        "--eval-every", type=number(int, 1), default=100, help="steps between held-out evaluations"
    )
    sft.add_argument(
        "--eval-size",
        type=number(int, 0),
        default=200,
        help="held-out problems (with --data: records kept out of training; 0: none)",
    )
    sft.add_argument(
        "--target-accuracy", type=number(float, 0), help="stop once held-out accuracy reaches this"
    )
    sft.add_argument("--save", help="write the model (HF checkpoint; with --lora-rank the PEFT adapter) here")
    add_field_flags(sft, list(SFT_LORA_FIELDS))  # as `miles train` has them
    sft.add_argument("--log", help="write per-step loss/accuracy JSONL here")
    sft.set_defaults(func=cmd_sft)

    plot = sub.add_parser(
        "plot",
        help="PNG curves of a run's metrics",
        description="Write PNG curves (reward, accuracy, KL, logprob mismatch, lengths) of RUN_DIR/metrics.jsonl into RUN_DIR/plots.",
    )
    plot.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    plot.add_argument("--compare", help="another run directory, drawn dashed on the same axes (a baseline)")
    plot.set_defaults(func=cmd_plot)
    doctor = sub.add_parser(
        "doctor",
        help="check a run for known symptoms and say which flags fix them",
        description="Read RUN_DIR (config.yaml, metrics.jsonl) and report each known symptom (loss explosion, "
        "reward collapse, train/rollout mismatch, MoE routing mismatch and imbalance, slow weight sync, memory "
        "growth, truncation; with --compare, an accuracy gap) with its evidence and the flags that fix it. Exit "
        "status: 0 healthy, 1 symptoms found, 2 error. Thresholds: docs/troubleshooting.md.",
    )
    doctor.add_argument("run_dir", nargs="?", help="a run directory (--output-dir of miles train)")
    doctor.add_argument(
        "--compare", metavar="OTHER_RUN", help="a reference run (e.g. full precision) to compare against"
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    doctor.add_argument(
        "--env",
        action="store_true",
        help="report the machine instead: torch/CUDA/NCCL, GPUs and peer access (CUDA IPC), /dev/shm, Ray, "
        "low-precision environment variables",
    )
    doctor.add_argument(
        "--model", help="with --env: also list the INT4 group sizes that divide this model's layers"
    )
    doctor.add_argument(
        "--localize-mismatch",
        metavar="RUN_DIR",
        help="replay the samples a run kept with --mismatch-dump-interval through the trainer's and the engine's "
        "forward, op by op, and name the first place they differ beyond rounding (exit 1 if they do)",
    )
    doctor.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="with --localize-mismatch: the relative difference counted as beyond rounding",
    )
    doctor.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    from miles.logs import setup_logging

    setup_logging("INFO")  # warnings and errors of every command reach the terminal
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "eval", "draft"):  # their flags are miles train's (miles.config)
        command = {"train": cmd_train, "eval": cmd_eval, "draft": cmd_draft}[argv[0]]
        try:
            return command(None, argv[1:])
        except MilesError as e:
            print(f"miles {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    try:
        args = parse_command(parser, argv)
    except MilesError as e:
        print(f"miles {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except MilesError as e:
        print(f"miles {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `miles doctor --json | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
