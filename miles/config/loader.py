"""Build a `RunConfig` from defaults < YAML file < command-line flags, then validate it.

Every mistake fails here, before any work starts, with the flag (or YAML key) named: unknown
names get the closest valid one suggested; features not built yet say so.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import logging
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from miles.config.schema import CoEvolutionSection, RunConfig, SpeculativeSection, env_switch
from miles.errors import ConfigError

log = logging.getLogger("miles")

ENV_NOT_YET: dict[str, str] = {}  # environment variables of features not built yet: refused

# flags of earlier versions: refused, naming what replaced them
RETIRED: dict[str, str] = {
    "rollout_fused_step": "use --rollout-decode-step fused (or auto, the default, which picks it where it runs)",
    "rollout_lean_decode": "the lean step was retired; --rollout-decode-step general runs the model's forward",
    "rollout_packed_gemm": "the lean step and its packed GEMMs were retired; see --rollout-decode-step",
    "rollout_onednn": "the oneDNN projections were retired with the lean step; see --rollout-decode-step",
    "rollout_compile": "the compiled lean step was retired (the fused step is faster on CPU); see --rollout-decode-step",
}


def retired_message(name: str) -> str | None:
    """The refusal for a retired flag or key (its --no- form too), else None."""
    bare = name.replace("-", "_").removeprefix("no_")
    if bare in RETIRED:
        return f"--{name.replace('_', '-')} is no longer a flag: {RETIRED[bare]}"
    return None


@dataclasses.dataclass
class FieldInfo:
    section: str
    name: str
    kind: Any  # int, float, str, bool, dict
    optional: bool
    default: Any
    meta: dict

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        return [self.flag] + ["--" + alias.replace("_", "-") for alias in self.meta["aliases"]]


def _fields() -> dict[str, FieldInfo]:
    out: dict[str, FieldInfo] = {}
    root_hints = typing.get_type_hints(RunConfig)
    for section in dataclasses.fields(RunConfig):
        cls = root_hints[section.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            optional = type(None) in typing.get_args(hint)
            kind = args[0] if args else hint
            kind = typing.get_origin(kind) or kind
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f.name] = FieldInfo(section.name, f.name, kind, optional, default, dict(f.metadata))
    return out


FIELDS = _fields()
ALIASES = {a: info.name for info in FIELDS.values() for a in info.meta["aliases"]}


def _json_object(info: FieldInfo, text: str, where: str) -> Any:
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where}: {info.flag} takes a JSON object, e.g. '{{\"max_digits\": 2}}' ({e})"
        ) from e


def _convert(info: FieldInfo, value: Any, where: str) -> Any:
    if info.kind is dict and isinstance(value, str):  # outside the try below: its own message
        value = _json_object(info, value, where)
    if value is None:
        if info.optional:
            return None
        raise ConfigError(f"{where}: {info.name} cannot be null")
    try:
        if info.kind is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError
            if not isinstance(value, bool):
                raise ValueError
            return value
        if info.kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if info.kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if info.kind is dict:
            if not isinstance(value, dict):
                raise ValueError
            return value
        if info.kind is list:  # a repeatable flag, or a YAML list (one string: a list of one)
            items = value if isinstance(value, list) else [value]
            if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
                raise ValueError
            return [str(v) for v in items]
        return str(value)
    except (TypeError, ValueError):
        kind = getattr(info.kind, "__name__", str(info.kind))
        raise ConfigError(f"{where}: {info.flag} expects {kind}, got {value!r}") from None


def _suggest(name: str, section: str | None = None) -> str:
    """'; did you mean --x?' for the closest valid name (within `section` first)."""
    pools = []
    if section:
        pools.append([f for f, info in FIELDS.items() if info.section == section])
    pools.append(list(FIELDS) + list(ALIASES))
    for pool in pools:
        close = difflib.get_close_matches(name, pool, n=1, cutoff=0.5)
        if close:
            return f"; did you mean --{close[0].replace('_', '-')}?"
    return ""


def build_train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="miles train",
        usage="miles train [--config FILE] [--FLAG VALUE ...]",
        description=(
            "Run RL post-training (GRPO by default). With no arguments: the embedded default job, a tiny MoE "
            "model learning arithmetic on CPU. Flags override --config YAML; names follow miles' docs, "
            "slime/miles spellings are accepted as aliases."
        ),
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", help="YAML file with the same keys (snake_case, flat or by section)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in FIELDS.values():
        if info.section not in groups:
            doc = typing.get_type_hints(RunConfig)[info.section].__doc__ or ""
            groups[info.section] = parser.add_argument_group(info.section, doc.strip())
        add_field_flag(groups[info.section], info.name)
    return parser


_OWN_DEFAULT = object()


def add_field_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, default: Any = argparse.SUPPRESS
) -> None:
    """The flag of config field `name`, as `miles train` spells and explains it (other commands
    reuse it, so one option has one spelling). `default`: SUPPRESS (train: unset flags stay
    unset), `_OWN_DEFAULT` (the field's), or a value of the command's own; `field_values` converts."""
    info = FIELDS[name]
    shown = info.default if default in (argparse.SUPPRESS, _OWN_DEFAULT) else default
    help_text = info.meta["help"]
    if info.meta["available"] is not True:
        help_text += " [not available yet]"
    if info.meta["bounds"] is not None:
        help_text += f" [{info.meta['bounds']}]"
    if info.kind is not bool and shown not in (None, {}, []):
        help_text += f" (default: {shown})"
    kwargs: dict[str, Any] = {"help": help_text, "dest": info.name}
    kwargs["default"] = info.default if default is _OWN_DEFAULT else default
    if info.kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif info.kind is dict:
        kwargs["metavar"] = "JSON"
    elif info.kind is list:
        kwargs["action"], kwargs["metavar"] = "append", info.name.upper()
    else:
        kwargs["metavar"] = info.name.upper()
        if info.meta["choices"]:
            kwargs["choices"] = info.meta["choices"]
    parser.add_argument(*info.flags, **kwargs)


def add_field_flags(parser: argparse.ArgumentParser, names: list[str], **defaults: Any) -> None:
    """`add_field_flag` for each name, with the field's default unless `defaults` gives one."""
    for name in names:
        add_field_flag(parser, name, defaults.get(name, _OWN_DEFAULT))


def field_values(
    args: argparse.Namespace, where: str = "command line", names: Sequence[str] | None = None
) -> dict[str, Any]:
    """Field name -> converted value for every config field present in `args` (or each of `names`)."""
    wanted = FIELDS if names is None else names
    return {k: _convert(FIELDS[k], v, where) for k, v in vars(args).items() if k in wanted}


def _flatten_yaml(data: Any, path: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        # `model:` is a section (a saved config.yaml) and a field (model: tiny): a mapping is the section
        field = FIELDS.get(key)
        if (
            key in sections
            and isinstance(value, dict)
            and (field is None or not isinstance(field.default, dict))
        ):
            for sub, v in value.items():
                sub = str(sub).replace("-", "_")
                name = ALIASES.get(sub, sub)
                if key == "co_evolution" and name == "interval":
                    name = "co_evolution_interval"
                if name not in FIELDS:
                    raise ConfigError(
                        f"{path}: {retired_message(name) or f'unknown key {key}.{sub}{_suggest(sub, key)}'}"
                    )
                flat[name] = v
        else:
            name = ALIASES.get(key, key)
            if name not in FIELDS:
                raise ConfigError(f"{path}: {retired_message(name) or f'unknown key {key!r}{_suggest(key)}'}")
            flat[name] = value
    return flat


def load_config(argv: list[str] | None = None) -> RunConfig:
    """Parse `miles train` arguments (and the --config file) into a validated `RunConfig`."""
    parser = build_train_parser()
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            raise ConfigError(
                retired_message(name) or f"unknown flag --{name.replace('_', '-')}{_suggest(name)}"
            )
        raise ConfigError(f"unexpected argument {token!r} (flags start with --; see miles train --help)")
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"--config {config_path}: no such file")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {config_path}: not valid YAML ({e})") from e
        for name, value in _flatten_yaml(data, str(path)).items():
            values[name] = _convert(FIELDS[name], value, str(path))
    values.update(field_values(args))
    return make_config(values)


def make_config(values: dict[str, Any]) -> RunConfig:
    """A validated `RunConfig` from field name -> value (anything unset keeps its default)."""
    cfg = RunConfig()
    for name, value in values.items():
        info = FIELDS.get(ALIASES.get(name, name))
        if info is None:
            raise ConfigError(retired_message(name) or f"unknown setting {name!r}{_suggest(name)}")
        setattr(getattr(cfg, info.section), info.name, value)
    cfg.given = frozenset(
        FIELDS[ALIASES.get(n, n)].name for n in values
    )  # set explicitly: beats the environment
    return validate(cfg)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _env_int4(precision, given: frozenset) -> None:
    """OPEN_TRAINING_INT4_FAKE_QAT_FLAG / OPEN_TRAINING_INT4_GROUP_SIZE into the configuration
    (an explicit --int4-qat / --no-int4-qat wins over the variable)."""
    if env_switch("OPEN_TRAINING_INT4_FAKE_QAT_FLAG") == "1" and "int4_qat" not in given:
        precision.int4_qat = True
    size = os.environ.get("OPEN_TRAINING_INT4_GROUP_SIZE", "").strip()
    if size:
        if not size.isdigit() or int(size) < 1:
            raise ConfigError(f"OPEN_TRAINING_INT4_GROUP_SIZE={size!r}: use a positive integer, e.g. 128")
        if precision.int4_group_size not in (None, int(size)):
            raise ConfigError(
                f"--int4-group-size {precision.int4_group_size} and OPEN_TRAINING_INT4_GROUP_SIZE={size} "
                "disagree; keep one"
            )
        precision.int4_group_size = int(size)


def validate_int4(cfg: RunConfig) -> None:
    """INT4 settings: what combines (the group size against the model is checked when it loads)."""
    precision = cfg.precision
    _env_int4(precision, getattr(cfg, "given", frozenset()))
    if not (precision.int4_qat or precision.int4_rollout_only):
        given = [
            flag
            for flag, value in (
                ("--int4-group-size (or OPEN_TRAINING_INT4_GROUP_SIZE)", precision.int4_group_size),
                ("--int4-skip-layers", precision.int4_skip_layers),
                ("--int4-kernel-activations", precision.int4_kernel_activations != "fp32"),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"{given[0]} has no effect without INT4; add --int4-qat (or OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1, "
                "or --int4-rollout-only) or remove it"
            )
        return
    if precision.int4_qat and precision.int4_rollout_only:
        raise ConfigError(
            "--int4-rollout-only keeps the trainer in full precision, but --int4-qat (or "
            "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1) quantizes it; use one"
        )
    if precision.fp8_recipe or precision.fp8_rollout_only:
        raise ConfigError("FP8 and INT4 in one run: choose --fp8-recipe or --int4-qat, not both")
    precision.int4_group_size = precision.int4_group_size or 128
    what = "--int4-qat" if precision.int4_qat else "--int4-rollout-only"
    _quantized_engine_limits(cfg, what, "INT4 groups", "packed INT4 codes")


def _quantized_engine_limits(cfg: RunConfig, what: str, blocks: str, codes: str) -> None:
    """What a quantized engine does not combine with (FP8 and INT4 alike)."""
    if cfg.train.warmup_precision and cfg.train.warmup_steps == 0:
        raise ConfigError(
            "--warmup-precision bf16 needs --warmup-steps N > 0 (the rollouts that run in bf16)"
        )
    if cfg.sync.rollout_num_gpus_per_engine > 1:
        raise ConfigError(
            f"{what} with --rollout-num-gpus-per-engine > 1: {blocks} of a tensor-parallel shard are not built "
            "yet; use one device per engine"
        )
    if cfg.sync.check_weight_update_equal:
        raise ConfigError(
            f"--check-weight-update-equal compares engine and trainer weights bit for bit, but with {what} the "
            f"engine stores {codes}; use one or the other"
        )


def validate_precision(cfg: RunConfig) -> None:
    """FP8 and INT4 settings: what combines, and the formats from the environment (read here, once)."""
    validate_int4(cfg)
    if cfg.precision.int4_qat or cfg.precision.int4_rollout_only:
        return
    precision = cfg.precision
    scales = env_switch("NVTE_FP8_BLOCK_SCALING_FP32_SCALES")
    if scales == "1" and "fp8_fp32_scales" not in getattr(cfg, "given", frozenset()):
        precision.fp8_fp32_scales = True
    if precision.fp8_rollout_only:
        precision.fp8_recipe = precision.fp8_recipe or "blockwise"
    if not precision.fp8_recipe:
        given = [
            flag
            for flag, value in (
                ("--fp8-skip-layers", precision.fp8_skip_layers),
                ("--fp8-fp32-scales (or NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1)", precision.fp8_fp32_scales),
                ("--fp8-format", precision.fp8_format),
                ("--fp8-dynamic-scaling", precision.fp8_dynamic_scaling),
                ("--warmup-precision", cfg.train.warmup_precision),
            )
            if value
        ]
        if given:
            raise ConfigError(
                f"{given[0]} has no effect without FP8 or INT4; add --fp8-recipe (or --fp8-rollout-only, or "
                "--int4-qat) or remove it"
            )
        return
    what = "--fp8-rollout-only" if precision.fp8_rollout_only else f"--fp8-recipe {precision.fp8_recipe}"
    if precision.fp8_dynamic_scaling and precision.fp8_recipe != "delayed":
        raise ConfigError(
            f"--fp8-dynamic-scaling changes only --fp8-recipe delayed; {precision.fp8_recipe} already scales each "
            "tensor by its own amax. Remove the flag"
        )
    _quantized_engine_limits(cfg, what, "FP8 blocks", "FP8 codes")


def validate_speculative(cfg: RunConfig) -> None:
    """Draft settings need a draft; an n-gram draft has no weights to train. `--draft-model none`
    turns off a draft the YAML set up, with the settings that go with it."""
    if cfg.speculative.draft_model == "none":
        cfg.speculative = SpeculativeSection()
    spec, default = cfg.speculative, SpeculativeSection()
    given = [
        flag
        for flag, value in (
            ("--online-sft-interval", spec.online_sft_interval),
            ("--draft-ema-decay", spec.draft_ema_decay is not None),
            ("--reinit-draft-interval", spec.reinit_draft_interval),
            ("--profile-speculative", spec.profile_speculative),
            ("--draft-layers", spec.draft_layers != default.draft_layers),
            ("--spec-lookahead", spec.spec_lookahead != default.spec_lookahead),
            ("--draft-lr", spec.draft_lr != default.draft_lr),
            ("--draft-vocab-size", spec.draft_vocab_size != default.draft_vocab_size),
            ("--eagle-head", spec.eagle_head is not None),
        )
        if value
    ]
    if spec.draft_model is None:
        if given:
            raise ConfigError(
                f"{given[0]} has no effect without a draft; add --draft-model auto (or ngram, or a path)"
            )
        return
    trained = [
        f for f in given if f in ("--online-sft-interval", "--draft-ema-decay", "--reinit-draft-interval")
    ]
    if spec.draft_model == "ngram" and trained:
        raise ConfigError(
            f"{trained[0]}: --draft-model ngram has no weights to train; use --draft-model auto"
        )
    if cfg.sync.rollout_num_gpus_per_engine > 1:
        raise ConfigError(
            "--draft-model with --rollout-num-gpus-per-engine > 1: a draft for a tensor-parallel engine is not built "
            "yet; use one device per engine"
        )
    if spec.draft_layers != default.draft_layers and spec.draft_model != "auto":
        raise ConfigError("--draft-layers sizes --draft-model auto; remove it or use --draft-model auto")
    if spec.draft_vocab_size != default.draft_vocab_size and spec.draft_model != "eagle":
        raise ConfigError(
            "--draft-vocab-size sizes --draft-model eagle; remove it or use --draft-model eagle"
        )
    if spec.eagle_head is not None and spec.draft_model != "eagle":
        raise ConfigError("--eagle-head starts --draft-model eagle; remove it or use --draft-model eagle")
    if spec.eagle_head is not None and spec.draft_vocab_size != default.draft_vocab_size:
        raise ConfigError(
            "--draft-vocab-size with --eagle-head: the saved head keeps the vocabulary it was trained with; "
            "remove --draft-vocab-size (or set it when running miles draft)"
        )
    if (spec.draft_ema_decay is not None or spec.reinit_draft_interval) and not spec.online_sft_interval:
        raise ConfigError(
            "--draft-ema-decay and --reinit-draft-interval act on a draft trained online; add --online-sft-interval N"
        )


def validate_co_evolution(cfg: RunConfig) -> None:
    """Co-evolution settings act only on a multi-agent environment; say so instead of ignoring them."""
    co = cfg.co_evolution
    if co.env_path:
        for agent, settings in co.agent_overrides.items():  # the agent names are checked against the env
            with_overrides(cfg, settings, f"--agent-overrides {agent}")
        resolve_magnet(cfg)
        return
    default = CoEvolutionSection()
    changed = [
        "--" + f.name.replace("_", "-")
        for f in dataclasses.fields(co)
        if getattr(co, f.name) != getattr(default, f.name)
    ]
    if changed:
        raise ConfigError(
            f"{', '.join(changed)} set the co-evolution of several agents, but no environment is given; "
            "add --env-path kuhn_poker (or module:Class), e.g. co_evolution: {env_path: kuhn_poker} in the YAML"
        )


def resolve_magnet(cfg: RunConfig) -> None:
    """--magnet-kl-coef's default: on (0.5) where one agent learns against opponents that stand
    still (--strategy alternating) or against past snapshots (--population-size): without the
    pull that learner turns deterministic within its phase and play ends worse than plain
    simultaneous updates; off for plain simultaneous updates (the run whose instability those
    remedies address), where --use-kl-loss asks for a fixed pull, and under LoRA (whose KL
    reference is its base). An explicit 0 with those remedies is warned about."""
    co, algo = cfg.co_evolution, cfg.algo
    remedied = co.strategy == "alternating" or co.population_size is not None
    if co.magnet_kl_coef is None:
        co.magnet_kl_coef = 0.5 if remedied and not (algo.use_kl_loss or cfg.lora.enabled) else 0.0
    elif co.magnet_kl_coef > 0 and cfg.lora.enabled:
        raise ConfigError(
            "--magnet-kl-coef with --lora-rank: LoRA's KL reference is its base and cannot move"
        )
    elif co.magnet_kl_coef == 0 and remedied and not algo.use_kl_loss:
        log.warning(
            "--magnet-kl-coef 0 with %s: the learner turns deterministic within its phase (a policy at P = 1 "
            "gets no gradient back) and play ends worse than simultaneous updates; drop magnet_kl_coef: 0 "
            "(the default here is 0.5) or pass --magnet-kl-coef 0.5",
            "--strategy alternating" if co.strategy == "alternating" else "--population-size",
        )


PER_AGENT_SECTIONS = ("train", "algo")


def with_overrides(cfg: RunConfig, settings: Any, where: str) -> RunConfig:
    """A validated copy of `cfg` with `settings` ({field: value} of the train/algo sections) set."""
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: expected a mapping of settings, got {settings!r}")
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        name = ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        info = FIELDS.get(name)
        if info is None:
            raise ConfigError(f"{where}: unknown setting {key!r}{_suggest(name)}")
        if info.section not in PER_AGENT_SECTIONS:
            raise ConfigError(
                f"{where}: {key} is a {info.section}: setting, shared by every agent; per agent: the "
                f"{' and '.join(PER_AGENT_SECTIONS)} sections (lr, kl_loss_coef, entropy_coef, eps_clip, ...)"
            )
        setattr(getattr(out, info.section), info.name, _convert(info, value, where))
    out.co_evolution.agent_overrides = {}  # the copy is one agent's: its overrides are applied
    return validate(out)


def validate_sglang(cfg: RunConfig) -> None:
    """The SGLang backend needs its servers, and takes the place of the engine's own features."""
    sg = cfg.sglang
    if sg.rollout_backend != "sglang":
        if sg.sglang_url:
            raise ConfigError(
                f"--sglang-url {sg.sglang_url} is set but the rollout backend is {sg.rollout_backend!r}; "
                "add --rollout-backend sglang"
            )
        return
    if not sg.sglang_url or not [u for u in sg.sglang_url.split(",") if u.strip()]:
        raise ConfigError(
            "--rollout-backend sglang needs --sglang-url http://HOST:PORT (comma-separate several)"
        )
    bad = [u for u in sg.sglang_url.split(",") if not u.strip().startswith(("http://", "https://"))]
    if bad:
        raise ConfigError(f"--sglang-url: {bad[0]!r} is not an http(s):// URL")
    clashes = {
        "--partial-rollout": cfg.rollout.partial_rollout,
        "--draft-model": cfg.speculative.draft_model,
        "--rollout-num-gpus": (cfg.sync.rollout_num_gpus or 1) > 1,
        "--debug-train-only": cfg.debug.debug_train_only,
        "--env-path": cfg.co_evolution.env_path,
    }
    on = [flag for flag, value in clashes.items() if value]
    if on:
        raise ConfigError(
            f"--rollout-backend sglang does not combine with {', '.join(on)} yet: the servers run the rollout "
            "(configure SGLang's own speculative decoding and parallelism on the server)"
        )


def validate_moe(cfg: RunConfig) -> None:
    """Expert parallelism needs a layout that holds it. (The expert count is checked against the
    model when it is loaded: `miles.train.expert_parallel`.)"""
    train, ranks = cfg.train, cfg.sync.training_ranks
    ep = train.expert_model_parallel_size
    if ep > 1 and ranks % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} must divide the {ranks} training ranks "
            f"(--actor-num-nodes x --actor-num-gpus-per-node); e.g. --actor-num-gpus-per-node {ep}"
        )


def true_on_policy_conflicts(cfg: RunConfig) -> list[tuple[str, str]]:
    """(flag, why) for each setting that --true-on-policy-mode cannot make bitwise on-policy."""
    precision, rollout, sync, train = cfg.precision, cfg.rollout, cfg.sync, cfg.train
    arithmetic = "the two sides would not run the same arithmetic"
    off_policy = "its rollouts come from older weights, so they are off-policy by design"
    candidates = [
        ("--fp8-recipe", precision.fp8_recipe, f"FP8 layers are not batch-invariant: {arithmetic}"),
        ("--int4-qat", precision.int4_qat, f"INT4 layers are not batch-invariant: {arithmetic}"),
        ("--int4-rollout-only", precision.int4_rollout_only, f"the engine would run INT4: {arithmetic}"),
        ("--rollout-backend sglang", cfg.sglang.rollout_backend == "sglang", f"SGLang runs its own kernels: {arithmetic}"),
        ("--moe-capacity-factor", train.moe_capacity_factor is not None, "a token's drop depends on its batch-mates"),
        ("--expert-model-parallel-size", train.expert_model_parallel_size > 1, f"sharded experts: {arithmetic}"),
        ("--rollout-num-gpus-per-engine", sync.rollout_num_gpus_per_engine > 1, f"tensor-parallel engines: {arithmetic}"),
        ("--async-weight-sync", sync.async_weight_sync, off_policy),
        ("--partial-rollout", rollout.partial_rollout, off_policy),
        ("--rollout-mode fully-async", sync.rollout_mode == "fully-async", off_policy),
        ("--update-weights-interval", sync.update_weights_interval > 1, off_policy),
        ("--lora-rank", cfg.lora.enabled, f"the engines serve the adapter merged into the weights: {arithmetic}"),
    ]  # fmt: skip
    return [(flag, why) for flag, on, why in candidates if on]


def validate_true_on_policy(cfg: RunConfig) -> None:
    """--true-on-policy-mode runs where both sides can compute the same bits, and says why not elsewhere."""
    if not cfg.algo.true_on_policy_mode:
        return
    conflicts = true_on_policy_conflicts(cfg)
    if conflicts:
        flag, why = conflicts[0]
        raise ConfigError(
            f"--true-on-policy-mode with {flag}: {why}. Remove one of them (docs/algorithms.md lists what "
            "true on-policy composes with)"
        )


def check_fields(cfg: RunConfig) -> None:
    """Each field on its own: available in this version, one of its choices, within its range."""
    for info in FIELDS.values():
        value = getattr(getattr(cfg, info.section), info.name)
        reason = info.meta["available"]
        if reason is not True and value != info.default:
            raise ConfigError(
                f"{info.flag} is not available yet in this version of miles: {reason}. Remove it to run."
            )
        if info.meta["choices"] and value is not None and value not in info.meta["choices"]:
            raise ConfigError(f"{info.flag} {value!r} is not one of {list(info.meta['choices'])}")
        bounds = info.meta["bounds"]
        if bounds is not None and value is not None and value not in bounds:
            raise ConfigError(f"{info.flag} must be {bounds}, got {value}")
    for var, reason in ENV_NOT_YET.items():
        if os.environ.get(var, "").strip() not in ("", "0"):
            raise ConfigError(f"environment variable {var} is set, but {reason}. Unset it to run.")


def resolve_batches(cfg: RunConfig) -> None:
    """The global batch from the rollout's samples and the steps per rollout; a micro-batch capped
    at it; the ranks it splits over; the group an estimator compares; a critic's warm-up."""
    rollout, train, algo = cfg.rollout, cfg.train, cfg.algo
    total = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if train.global_batch_size is None:
        if total % train.num_steps_per_rollout:
            raise ConfigError(
                f"rollout_batch_size x n_samples_per_prompt = {total} samples do not split into "
                f"--num-steps-per-rollout {train.num_steps_per_rollout} equal optimizer steps"
            )
        train.global_batch_size = total // train.num_steps_per_rollout
    elif train.global_batch_size * train.num_steps_per_rollout != total:
        raise ConfigError(
            f"--rollout-batch-size {rollout.rollout_batch_size} x --n-samples-per-prompt {rollout.n_samples_per_prompt} = {total} "
            f"must equal --global-batch-size {train.global_batch_size} x --num-steps-per-rollout {train.num_steps_per_rollout}"
        )
    train.micro_batch_size = min(train.micro_batch_size, train.global_batch_size)
    world = cfg.sync.training_ranks
    if world > 1 and train.global_batch_size % world:
        raise ConfigError(
            f"--global-batch-size {train.global_batch_size} must split evenly over the {world} training ranks "
            "(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    if algo.advantage_estimator in ("grpo", "gspo", "rloo") and rollout.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--advantage-estimator {algo.advantage_estimator} compares samples of a prompt: --n-samples-per-prompt must be >= 2"
        )
    if algo.advantage_estimator == "ppo" and algo.critic_warmup >= rollout.num_rollout:
        raise ConfigError(
            f"--critic-warmup {algo.critic_warmup} leaves no rollout of the {rollout.num_rollout} to train the policy"
        )


def validate_layout(cfg: RunConfig) -> None:
    """What a run's processes and devices allow."""
    sync, debug = cfg.sync, cfg.debug
    if cfg.rollout.partial_rollout and sync.rollout_num_gpus_per_engine > 1:
        raise ConfigError(
            "--partial-rollout with --rollout-num-gpus-per-engine > 1: stopping a tensor-parallel engine "
            "mid-rollout is not built yet; use one device per engine"
        )
    if debug.debug_train_only and (sync.training_ranks > 1 or (sync.rollout_num_gpus or 1) > 1):
        raise ConfigError("--debug-train-only runs in one process: drop the Ray layout flags")
    if debug.debug_rollout_only and (cfg.checkpoint.save or cfg.checkpoint.save_hf):
        raise ConfigError(
            "--debug-rollout-only never trains, so there is nothing to --save / --save-hf; drop one of them"
        )
    if cfg.model.device == "cuda" and not _cuda_visible():
        raise ConfigError(
            "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); use --device cpu"
        )


def validate(given: RunConfig) -> RunConfig:
    """Check every setting, before any work; return the resolved configuration (the global
    batch, a capped micro-batch, what flags imply). `given` itself is left as it was. Each
    section checks its own fields (`check`); the rules here span sections."""
    cfg = copy.deepcopy(given)
    check_fields(cfg)
    for section in dataclasses.fields(cfg):
        check = getattr(getattr(cfg, section.name), "check", None)
        if check is not None:
            check()
    resolve_batches(cfg)
    validate_precision(cfg)
    validate_speculative(cfg)
    validate_moe(cfg)
    validate_co_evolution(cfg)
    validate_sglang(cfg)
    validate_layout(cfg)
    validate_true_on_policy(cfg)
    validate_lora(cfg)
    validate_agents(cfg)
    validate_opd(cfg)
    validate_faults(cfg)
    validate_overlong(cfg)
    validate_async(cfg)
    return cfg


def validate_async(cfg: RunConfig) -> None:
    """Fully-async rollouts replace partial rollout, and need an off-policy correction.

    A fully-async run trains tokens up to --max-staleness versions old: without a correction the
    ratio to the policy that sampled them goes unchecked, which can collapse a run, so it is
    refused unless --allow-uncorrected-async accepts that. A one-step --async-weight-sync run
    (staleness <= 1) is only warned: it is the established mode and far milder."""
    sync, algo = cfg.sync, cfg.algo
    fully_async = sync.rollout_mode == "fully-async"
    if fully_async:
        clashes = {
            "--partial-rollout": cfg.rollout.partial_rollout,
            "--rollout-backend sglang": cfg.sglang.rollout_backend == "sglang",
            "--debug-train-only": cfg.debug.debug_train_only,
            "--rollout-num-gpus-per-engine > 1": sync.rollout_num_gpus_per_engine > 1,
            cfg.agent.mode_flag or "": cfg.agent.mode_flag is not None,
            "--env-path": bool(cfg.co_evolution.env_path),
        }
        on = [flag for flag, value in clashes.items() if value]
        if on:
            raise ConfigError(
                f"--rollout-mode fully-async does not combine with {', '.join(on)}: it carries unfinished "
                "responses itself (what --partial-rollout does), on single-turn rollouts of miles' own engines"
            )
    if not (fully_async or sync.async_weight_sync) or algo.use_tis or algo.use_opsm:
        return
    if sync.allow_uncorrected_async:
        log.warning(
            "async rollout without an off-policy correction (--allow-uncorrected-async): stale tokens are "
            "trained as if on-policy"
        )
    elif fully_async:
        raise ConfigError(
            "--rollout-mode fully-async trains tokens from older weights and needs an off-policy correction: add "
            "--use-tis (truncated importance sampling; --tis-mode mask for MIS) or --use-opsm, or accept the risk "
            "with --allow-uncorrected-async"
        )
    else:
        log.warning(
            "--async-weight-sync without an off-policy correction: tokens one version old are trained as if "
            "on-policy; add --use-tis or --use-opsm (or --allow-uncorrected-async to silence this)"
        )


def validate_overlong(cfg: RunConfig) -> None:
    """The punished buffer lies inside the response budget."""
    buffer, cap = cfg.reward.overlong_buffer_len, cfg.rollout.rollout_max_response_len
    if buffer >= cap:
        raise ConfigError(
            f"--overlong-buffer-len {buffer} must be below --rollout-max-response-len {cap}: the penalty starts "
            f"{buffer} tokens before the cap; e.g. --overlong-buffer-len {max(1, cap // 4)}"
        )
    if cfg.reward.overlong_penalty_factor != 1.0 and not buffer:
        raise ConfigError(
            "--overlong-penalty-factor scales --overlong-buffer-len's penalty; add --overlong-buffer-len L"
        )


def validate_faults(cfg: RunConfig) -> None:
    """A fault must name a part this run has, at a point it reaches."""
    from miles.faults import parse_fault

    sync = cfg.sync
    ray_ranks = sync.actor_num_nodes * sync.actor_num_gpus_per_node > 1 or (sync.rollout_num_gpus or 1) > 1
    ray_engines = ray_ranks and cfg.sglang.rollout_backend != "sglang" and not cfg.debug.debug_train_only
    needs = {
        "engine": (ray_engines, "Ray engine actors: add --rollout-num-gpus 2"),
        "rank": (ray_ranks, "Ray training ranks: add --actor-num-gpus-per-node 2"),
        "reward": (bool(cfg.reward.custom_rm_path), "reward worker processes: add --custom-rm-path"),
        "driver": (True, ""),
    }
    for spec in cfg.debug.fault_inject:
        fault = parse_fault(spec)
        has, what = needs[fault.target]
        if not has:
            raise ConfigError(
                f"--fault-inject {spec}: this run has no {fault.target} to kill; it needs {what}"
            )
        if cfg.co_evolution.env_path and fault.target != "driver":
            raise ConfigError(
                f"--fault-inject {spec}: a multi-agent run (--env-path) takes driver faults (e.g. driver@step:2); "
                f"its agents' engines, ranks and rewards are not targets"
            )
        if fault.point == "checkpoint" and not cfg.checkpoint.save:
            raise ConfigError(f"--fault-inject {spec}: the run writes no checkpoint; add --save DIR")
        if fault.rollout >= cfg.rollout.num_rollout:
            raise ConfigError(
                f"--fault-inject {spec}: the fault would never fire; ROLLOUT must be below --num-rollout "
                f"{cfg.rollout.num_rollout}"
            )


def validate_opd(cfg: RunConfig) -> None:
    """On-policy distillation: the teacher is the run's one KL reference, held by the trainer in this process."""
    algo = cfg.algo
    if not algo.use_opd:
        changed = [
            f
            for f, on in (
                ("--opd-teacher-load", algo.opd_teacher_load),
                ("--opd-teacher-url", algo.opd_teacher_url),
                ("--opd-type", algo.opd_type != "advantage"),
                ("--opd-topk-per-position", algo.opd_topk_per_position),
            )
            if on
        ]
        if changed:
            raise ConfigError(f"{changed[0]} configures on-policy distillation; add --use-opd")
        return
    if bool(algo.opd_teacher_load) == bool(algo.opd_teacher_url):
        raise ConfigError(
            "--use-opd needs one teacher: --opd-teacher-load MODEL (a model as --model takes it) or "
            "--opd-teacher-url URL (a server)" + (", not both" if algo.opd_teacher_load else "")
        )
    if algo.opd_topk_per_position and algo.opd_type != "loss":
        raise ConfigError(
            "--opd-topk-per-position shapes the loss form's KL (--opd-type loss); the advantage form uses the "
            "sampled token's log-probs only: add --opd-type loss or drop it"
        )
    if algo.opd_teacher_url:
        if algo.opd_type == "loss" and not algo.opd_topk_per_position:
            raise ConfigError(
                "--opd-teacher-url with --opd-type loss: a teacher server sends log-probs, not weights; add "
                "--opd-topk-per-position K (it sends its K likeliest tokens a position), or use --opd-type "
                "advantage, or --opd-teacher-load"
            )
        return  # the server scores: any layout, and the trainer's KL reference stays free
    for flag, on in (
        ("--use-kl-loss", algo.use_kl_loss),
        ("--kl-coef", algo.kl_coef > 0),
        ("--lora-rank", cfg.lora.enabled),
    ):
        if on:
            raise ConfigError(
                f"--use-opd with {flag}: the teacher is the run's KL reference; a second reference (the initial "
                "policy, or LoRA's base) is not supported together with it"
            )
    ranks = cfg.sync.actor_num_nodes * cfg.sync.actor_num_gpus_per_node
    if ranks > 1 or cfg.sglang.rollout_backend == "sglang" or (cfg.sync.rollout_num_gpus or 1) > 1:
        raise ConfigError(
            "--use-opd runs in one process for now (the teacher sits beside the trainer); drop the Ray/SGLang "
            "layout flags"
        )


def validate_agents(cfg: RunConfig) -> None:
    """Multi-turn rollouts run whole conversations per step; partial rollout cuts and carries
    single responses, and co-evolution plays its own episodes."""
    mode = cfg.agent.mode_flag
    if mode is None:
        return
    for flag, on in (
        ("--partial-rollout", cfg.rollout.partial_rollout),
        ("--env-path", cfg.co_evolution.env_path),
    ):
        if on:
            raise ConfigError(
                f"{mode} with {flag}: multi-turn agent rollouts do not combine with it yet; drop one"
            )


def validate_lora(cfg: RunConfig) -> None:
    """LoRA runs with every layout except tensor-parallel engines (whose shards would need the
    adapter cut the same way)."""
    if cfg.lora.enabled and cfg.sync.rollout_num_gpus_per_engine > 1:
        raise ConfigError(
            "--lora-rank with --rollout-num-gpus-per-engine > 1: tensor-parallel engines do not merge LoRA adapters "
            "yet; use one device per engine (more engines: --rollout-num-gpus)"
        )


def describe(cfg: RunConfig) -> str:
    """Every setting that differs from its default, one `section.name = value` per line."""
    lines = []
    for info in FIELDS.values():
        value = getattr(getattr(cfg, info.section), info.name)
        if value != info.default:
            lines.append(f"  {info.section}.{info.name} = {value!r}")
    return "\n".join(lines) or "  (all defaults)"


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def run_config(path: Path) -> RunConfig:
    """The configuration a run saved (`<run dir>/config.yaml`, `to_dict`'s sections), validated again."""
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; is {path.parent} a run directory of miles train?")
    return load_config(["--config", str(path)])
