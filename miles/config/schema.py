"""The run configuration: one typed tree, each field with its default and help in one place.

Flag names are the field names with dashes (`--rollout-batch-size`); miles' own names are
primary and the slime/Megatron spellings are aliases. YAML files
use the same names in snake_case, flat or nested by section.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from miles.config.fields import option
from miles.errors import ConfigError


def _directory_or_absent(flag: str, value: str | None) -> None:
    if value and Path(value).exists() and not Path(value).is_dir():
        raise ConfigError(f"{flag} {value}: is a file; give a directory (it is created when missing)")


def env_switch(name: str) -> str:
    """An on/off environment variable: "", "0" or "1" (anything else is an error naming it)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"environment variable {name}={value!r}: use 1 (on) or 0 (off), or unset it")
    return value


@dataclass
class ModelSection:
    """Which model to train."""

    model: str = option(
        "tiny",
        "checkpoint directory, .gguf file, or tiny / tiny-random / smollm2",
        aliases=("hf_checkpoint",),
    )
    device: str = option(
        "cpu",
        "where models compute: cpu, cuda (each Ray actor its own GPU; NCCL between training ranks) or auto "
        "(cuda when visible)",
        choices=("cpu", "cuda", "auto"),
    )
    prerequisites: dict = option(
        {},
        "paths this run reads that another command makes, each with that command (path: command); a missing "
        "one stops the run before any work and names its command (examples that start from another run's "
        "output say how to make it)",
    )

    def check(self) -> None:
        for path, command in self.prerequisites.items():
            if not Path(path).exists():
                raise ConfigError(
                    f"{path} does not exist yet: this configuration starts from it; make it with `{command}`"
                )


@dataclass
class DataSection:
    """Prompts, tasks and evaluation."""

    task: str | None = option(
        None,
        "a reasoning-gym task as prompt source and reward, e.g. basic_arithmetic, countdown; or shapes (images "
        "of squares to count, for a vision-language model)",
    )
    task_config: dict = option(
        {}, "keyword arguments for the reasoning-gym task: a YAML mapping, or JSON on the command line"
    )
    task_size: int = option(20_000, "how many task problems to generate for training", bounds="[1, inf)")
    prompt_data: str | None = option(None, "JSONL or Parquet file of prompts")
    input_key: str = option("input", "field of --prompt-data holding the prompt")
    label_key: str | None = option("label", "field of --prompt-data holding the reference answer")
    metadata_key: str | None = option(None, "field of --prompt-data passed to the reward as metadata")
    multimodal_keys: dict = option(
        {},
        'fields of --prompt-data holding each prompt\'s images, as JSON: {"image": "images"} (a list of paths, '
        "relative to the file, or bytes); the prompt marks where each goes with <image>",
    )
    apply_chat_template: bool = option(
        False, "wrap each prompt in the tokenizer's chat template as a user turn"
    )
    eval_prompt_data: str | None = option(
        None, "JSONL or Parquet file of held-out prompts (default: held-out task problems)"
    )
    eval_size: int = option(
        200, "held-out task problems to evaluate on (0: no evaluation)", bounds="[0, inf)"
    )
    eval_interval: int = option(
        10, "evaluate every N rollouts (0: only at the start and the end)", bounds="[0, inf)"
    )
    n_samples_per_eval_prompt: int = option(
        1,
        "samples per held-out prompt: 1 decodes greedily; more sample at --eval-temperature and report pass@k "
        "for k = 1, 2, 4, ... and n",
        bounds="[1, inf)",
    )
    eval_temperature: float | None = option(
        None,
        "sampling temperature of the held-out set (default: 0 with one sample per prompt, else "
        "--rollout-temperature)",
        bounds="[0, inf)",
    )
    eval_engine: str = option(
        "rollout",
        "where evaluation runs: rollout (the rollout engines, between steps; training waits) | own (an engine of "
        "its own in this process, from a copy of the weights at that step, while training goes on; logged when "
        "ready under the step it evaluates)",
        choices=("rollout", "own"),
    )
    eval_config: str | None = option(
        None,
        "YAML file of named evaluation sets, logged as eval_<name>_*: `eval: [{name, task, task_config, size} "
        "or {name, prompt_data, input_key, label_key}, with n_samples and temperature]`",
    )

    def check(self) -> None:
        if self.task and self.prompt_data:
            raise ConfigError("give --task or --prompt-data, not both")
        for flag, value in (
            ("--prompt-data", self.prompt_data),
            ("--eval-prompt-data", self.eval_prompt_data),
            ("--eval-config", self.eval_config),
        ):
            if value and not Path(value).is_file():
                raise ConfigError(f"{flag} {value}: no such file")


@dataclass
class RolloutSection:
    """Generation of samples."""

    num_rollout: int = option(100, "number of RL steps (rollout + train)", bounds="[1, inf)")
    rollout_batch_size: int = option(32, "prompts per rollout", bounds="[1, inf)")
    n_samples_per_prompt: int = option(8, "responses per prompt (the GRPO group)", bounds="[1, inf)")
    rollout_max_response_len: int = option(
        64, "maximum new tokens per response", bounds="[1, inf)", aliases=("max_new_tokens",)
    )
    rollout_temperature: float = option(
        1.0, "sampling temperature (0: greedy)", bounds="[0, inf)", aliases=("temperature",)
    )
    rollout_top_p: float = option(1.0, "nucleus sampling; keep 1.0 for unbiased RL logprobs", bounds="(0, 1]")
    rollout_top_k: int = option(-1, "top-k sampling; -1 = off", bounds="[-1, inf)")
    rollout_max_batch_size: int = option(
        256,
        "requests the engine decodes at once (KV-cache slots)",
        bounds="[1, inf)",
        aliases=("max_batch_size",),
    )
    rollout_seed: int = option(0, "engine sampling seed", bounds="[0, inf)")
    rollout_decode_step: str = option(
        "auto",
        "how the engine runs the model: fused (each decode step and prefill one C++ call; CPU, fp32), general "
        "(the model's own forward: any device and option), or auto (fused where it runs, else general; the run "
        "log says which and why)",
        choices=("auto", "fused", "general"),
    )
    over_sampling_batch_size: int | None = option(
        None,
        "prompts to draw per rollout before dynamic-sampling filters (default: rollout_batch_size)",
        bounds="[1, inf)",
    )
    dynamic_sampling_filter_path: str | None = option(
        None,
        "module:function keeping a group (True) or dropping it; 'default' drops groups whose rewards are all equal",
    )
    partial_rollout: bool = option(
        False,
        "stop a rollout once --rollout-batch-size groups are complete (of --over-sampling-batch-size in flight) and "
        "carry the unfinished responses, tokens and log-probs kept, to the next rollout under the new weights",
    )
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "with --partial-rollout: leave the tokens a carried response got from older weights out of the loss "
        "(instead of correcting them with --use-tis)",
    )

    mem_fraction_static: float = option(
        0.5,
        "share of the memory free when an engine starts (its weights loaded) that its KV cache may hold; requests "
        "beyond it wait in the engine's queue, and a context that cannot fit is refused at start (SGLang's flag; "
        "there the share also counts the weights)",
        bounds="(0, 1]",
    )

    @property
    def logprob_temperature(self) -> float:
        """The temperature every log-prob of the run is taken at (engine, trainer, teacher,
        localisation): the sampling one, and 1 for greedy rollouts (temperature 0), whose
        recorded log-probs are those of softmax(logits) (`miles.rollout.sampling`)."""
        return self.rollout_temperature or 1.0

    def engine_options(self) -> dict:
        """The Engine keyword arguments this section sets for every engine, local or Ray: its
        decode step and its KV-cache memory share."""
        return dict(decode_step=self.rollout_decode_step, mem_fraction_static=self.mem_fraction_static)

    def check(self) -> None:
        if self.rollout_top_k == 0:
            raise ConfigError("--rollout-top-k must be -1 (off) or >= 1, got 0")
        if (
            self.over_sampling_batch_size is not None
            and self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ConfigError("--over-sampling-batch-size must be >= --rollout-batch-size")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ConfigError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")
        if self.partial_rollout and (self.over_sampling_batch_size or 0) <= self.rollout_batch_size:
            raise ConfigError(
                "--partial-rollout stops a rollout once --rollout-batch-size groups are done out of more in flight; "
                f"add --over-sampling-batch-size above {self.rollout_batch_size} (e.g. "
                f"{2 * self.rollout_batch_size}), or there is nothing to carry over"
            )


@dataclass
class RewardSection:
    """How responses are scored."""

    rm_type: str = option(
        "auto",
        "auto (the task's scorer, else exact), exact, boxed, last_number (the last number equals the label: "
        "for answers in a sentence), reasoning_gym, code (the program passes the label's tests: the fraction); "
        "remote_rm (server at --rm-url), llm_judge (a judge behind the OpenAI-compatible --rm-url) or model "
        "(the reward model at --rm-path)",
        choices=(
            "auto",
            "exact",
            "boxed",
            "last_number",
            "reasoning_gym",
            "code",
            "remote_rm",
            "llm_judge",
            "model",
        ),
    )
    rm_path: str | None = option(None, "--rm-type model: the reward model `miles rm --save` wrote")
    rm_url: str | None = option(
        None,
        "remote_rm: the reward server (POST one sample, or --rm-batch-size of them, get rewards); llm_judge: the "
        "judge's OpenAI-compatible base URL, e.g. http://127.0.0.1:30000/v1 (miles serve answers there)",
    )
    judge_model: str = option("judge", "llm_judge: the model name sent to the judge's server")
    judge_template: str | None = option(
        None,
        "llm_judge: a text file with the question put to the judge ({prompt}, {response}, {label} are filled in); "
        "the judge must end with 'SCORE: 1' or 'SCORE: 0' (or a fraction). Default: a built-in grading prompt",
    )
    rm_batch_size: int = option(
        1, "samples per request to --rm-url (1: slime's one-sample payload)", bounds="[1, inf)"
    )
    rm_max_concurrency: int = option(16, "requests to --rm-url in flight at once", bounds="[1, inf)")
    rm_retries: int = option(
        3, "retries of a request to --rm-url that got no answer or a 5xx", bounds="[0, inf)"
    )
    custom_rm_path: str | None = option(
        None, "module:function reward(sample) -> float (sync or async); replaces --rm-type"
    )
    group_rm: bool = option(False, "the custom reward takes a whole group and returns a list of floats")
    reward_num_workers: int = option(
        4,
        "processes that run --custom-rm-path calls (each imports the function once; a hung call's process is "
        "killed and replaced)",
        bounds="[1, inf)",
    )
    overlong_buffer_len: int = option(
        0,
        "DAPO's soft overlong punishment: a response longer than --rollout-max-response-len minus L tokens loses "
        "reward linearly, up to --overlong-penalty-factor at the cap (0: off)",
        bounds="[0, inf)",
    )
    overlong_penalty_factor: float = option(
        1.0, "the reward an overlong response loses at --rollout-max-response-len", bounds="(0, inf)"
    )
    reward_timeout: float = option(
        30.0,
        "seconds before a reward call counts as failed (reward 0) and its process is killed",
        bounds="(0, inf)",
    )
    code_timeout: float = option(
        5.0,
        "code: wall-clock seconds of one test run of the program (also its CPU seconds)",
        bounds="(0, inf)",
    )
    code_memory_mb: int = option(512, "code: address space of one test run, in MiB", bounds="[16, inf)")
    code_file_mb: int = option(16, "code: largest file one test run may write, in MiB", bounds="[1, inf)")

    def check(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [
            n for n in ("code_timeout", "code_memory_mb", "code_file_mb") if getattr(self, n) != defaults[n]
        ]
        if changed and self.rm_type != "code":
            flag = "--" + changed[0].replace("_", "-")
            raise ConfigError(f"{flag} limits the programs of --rm-type code; add --rm-type code")
        remote = self.rm_type in ("remote_rm", "llm_judge")
        if remote != (self.rm_url is not None):
            raise ConfigError(
                f"--rm-type {self.rm_type} needs --rm-url URL (its server)"
                if self.rm_url is None
                else "--rm-url is the server of --rm-type remote_rm or llm_judge; add one of them"
            )
        if (self.rm_type == "model") != (self.rm_path is not None):
            raise ConfigError(
                "--rm-type model needs --rm-path DIR (a reward model miles rm saved)"
                if self.rm_path is None
                else "--rm-path is the reward model of --rm-type model; add --rm-type model"
            )
        if self.judge_template is not None:
            if self.rm_type != "llm_judge":
                raise ConfigError(
                    "--judge-template is the question of --rm-type llm_judge; add --rm-type llm_judge"
                )
            if not Path(self.judge_template).is_file():
                raise ConfigError(f"--judge-template {self.judge_template}: no such file")
        if self.rm_url is not None and not self.rm_url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url {self.rm_url!r}: expected an http:// or https:// URL")


@dataclass
class AlgoSection:
    """Advantages, losses and train/inference mismatch corrections."""

    advantage_estimator: str = option(
        "grpo",
        "grpo | gspo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo (a learned critic and "
        "GAE: --lambd, --value-clip, --critic-lr, --critic-warmup)",
        choices=("grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"),
    )
    disable_grpo_std_normalization: bool = option(
        False, "Dr.GRPO: advantages r - mean(group), no division by std"
    )
    normalize_advantages: bool = option(False, "whiten advantages over the batch's response tokens")
    eps_clip: float = option(0.2, "PPO clip epsilon (lower)", bounds="(0, 1)")
    eps_clip_high: float | None = option(
        None, "PPO clip epsilon (upper; DAPO clip-higher uses 0.28); default = eps_clip", bounds="(0, inf)"
    )
    eps_clip_c: float | None = option(
        None, "dual-clip constant (> 1) bounding the loss of negative advantages", bounds="(1, inf)"
    )
    policy_loss: str = option(
        "ppo",
        "ppo (clipped surrogate) | cispo (the clipped ratio as a detached weight on A * logp: every token keeps "
        "its gradient; bounded above by 1 + --eps-clip-high)",
        choices=("ppo", "cispo"),
    )
    use_opsm: bool = option(
        False,
        "off-policy sequence masking: drop negative-advantage tokens of a sequence whose mean "
        "log(pi_rollout / pi_theta) exceeds --opsm-delta",
    )
    opsm_delta: float = option(1e-4, "OPSM threshold on a sequence's mean log-ratio", bounds="[0, inf)")
    loss_agg_mode: str = option(
        "token-mean",
        "token-mean | seq-mean-token-mean | seq-mean-token-sum-norm",
        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    entropy_coef: float = option(0.0, "weight of the entropy bonus", bounds="[0, inf)")
    use_kl_loss: bool = option(False, "add a KL(policy || reference) loss term")
    kl_loss_coef: float = option(0.0, "weight of the KL loss term", bounds="[0, inf)")
    kl_loss_type: str = option(
        "low_var_kl", "KL estimator: k1 | k2 | k3 | low_var_kl", choices=("k1", "k2", "k3", "low_var_kl")
    )
    kl_coef: float = option(0.0, "KL penalty in the reward (REINFORCE++)", bounds="[0, inf)")
    use_opd: bool = option(
        False,
        "on-policy distillation: a teacher (--opd-teacher-load) scores the policy's own samples; the per-token "
        "reverse KL to it enters the advantage or the loss (--opd-type)",
    )
    opd_teacher_load: str | None = option(
        None, "the teacher of --use-opd: a model as --model takes it (the same tokenizer and vocabulary)"
    )
    opd_teacher_url: str | None = option(
        None,
        "the teacher of --use-opd behind a server (SGLang or miles serve, its /generate): it scores each sample's "
        "tokens with a prefill-only request; the loss form needs --opd-topk-per-position",
    )
    opd_type: str = option(
        "advantage",
        "advantage: A_t -= coef * (log pi(y_t) - log pi_teacher(y_t)) on each sampled token | loss: coef * "
        "KL(pi || pi_teacher) added to the loss (--kl-loss-type's estimator)",
        choices=("advantage", "loss"),
    )
    opd_kl_coef: float = option(1.0, "weight of the reverse KL to the teacher", bounds="[0, inf)")
    opd_topk_per_position: int | None = option(
        None,
        "--opd-type loss: the KL to the teacher over K + 1 bins per position (the teacher's K likeliest tokens "
        "and the rest), from K log-probs a position; works with --opd-teacher-url (SGLang's top_logprobs_num)",
        bounds="[1, inf)",
    )
    gamma: float = option(1.0, "discount (REINFORCE++ returns, GAE)", bounds="[0, 1]")
    lambd: float = option(
        1.0, "GAE lambda (--advantage-estimator ppo)", aliases=("lam", "gae_lambda"), bounds="[0, 1]"
    )
    value_clip: float | None = option(
        0.2,
        "PPO critic: clip each value's change to +-value_clip around its old value in the value loss",
        aliases=("cliprange_value",),
        bounds="(0, inf)",
    )
    critic_model: str | None = option(
        None, "PPO critic's initial weights (default: the policy's checkpoint), with a new scalar value head"
    )
    critic_lr: float | None = option(None, "PPO critic learning rate (default: --lr)", bounds="(0, inf)")
    critic_lr_warmup_steps: int = option(
        0, "linear warm-up steps of the critic's learning rate", bounds="[0, inf)"
    )
    critic_warmup: int = option(
        0,
        "PPO: the first N rollouts train the critic only (the policy waits for useful values)",
        aliases=("num_critic_only_steps",),
        bounds="[0, inf)",
    )
    use_tis: bool = option(
        False, "truncated importance sampling: weight each token by min(pi_train / pi_rollout, tis_clip)"
    )
    tis_clip: float = option(2.0, "TIS upper bound C", bounds="(0, inf)")
    tis_clip_low: float = option(0.0, "TIS lower bound", bounds="[0, inf)")
    tis_threshold: float | None = option(
        None,
        "trust band (0, 1]: tokens whose ratio is outside [t, 1/t] are masked (implies --use-tis)",
        bounds="(0, 1]",
    )
    tis_mode: str = option("truncate", "truncate (TIS) or mask (MIS / icepop)", choices=("truncate", "mask"))
    tis_level: str = option(
        "token", "token | sequence | geometric importance ratio", choices=("token", "sequence", "geometric")
    )
    use_r3: bool = option(
        False,
        "Rollout Routing Replay: replay the engine's MoE routing in training",
        aliases=("use_rollout_routing_replay",),
    )
    r3_buffer_size: int | None = option(
        None,
        "with --use-r3: keep the routing records of at most N samples (oldest evicted first, stored as int8/int16); "
        "training a sample whose record was evicted is an error naming the size that would fit (unset: one record "
        "per sample in flight, no bound)",
        bounds="[1, inf)",
    )
    verify_logprobs: bool = option(
        False,
        "check trainer vs rollout logprobs every step; stop when the mean gap exceeds --verify-logprobs-threshold",
    )
    verify_logprobs_threshold: float = option(
        0.1, "mean |logp_train - logp_rollout| above which --verify-logprobs stops the run", bounds="(0, inf)"
    )
    true_on_policy_mode: bool = option(
        False,
        "trainer and engines compute every token with the same batch-invariant arithmetic (the kernels of "
        "--deterministic-expert-routing, for dense models too), so train and rollout log-probs are bitwise "
        "equal; slower (docs/algorithms.md lists what it composes with)",
    )
    deterministic_expert_routing: bool = option(
        False,
        "batch-invariant MoE routing and log-probs in trainer and engines: fixed-tile GEMMs, blocked attention and "
        "ties broken by expert index, so a sequence routes (and scores) bitwise the same alone, in any batch and "
        "under any padding (slower: see docs/moe.md)",
    )

    @property
    def teacher_in_trainer(self) -> bool:
        """--use-opd with --opd-teacher-load: the trainer holds the teacher as its KL reference."""
        return self.use_opd and bool(self.opd_teacher_load)

    @property
    def opd_topk(self) -> int:
        """--opd-topk-per-position of the loss form (0: off): the loss's KL to the teacher is then
        the binned one, from the teacher's top-k the samples carry (teacher loaded or served)."""
        return (self.opd_topk_per_position or 0) if self.use_opd and self.opd_type == "loss" else 0

    def check(self) -> None:
        """Its own rules; --tis-threshold implies --use-tis."""
        critic_flags = {
            "--critic-model": self.critic_model,
            "--critic-lr": self.critic_lr,
            "--critic-warmup": self.critic_warmup,
        }
        if self.advantage_estimator != "ppo" and (given := [f for f, v in critic_flags.items() if v]):
            raise ConfigError(
                f"{given[0]} sets up the PPO critic; add --advantage-estimator ppo or remove it"
            )
        if self.tis_threshold is not None:
            self.use_tis = True
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            raise ConfigError(
                f"--kl-loss-coef {self.kl_loss_coef} has no effect without --use-kl-loss; add --use-kl-loss "
                "(or use --kl-coef for the KL penalty in the reward)"
            )
        if self.tis_clip_low > self.tis_clip:
            raise ConfigError(f"--tis-clip-low {self.tis_clip_low} is above --tis-clip {self.tis_clip}")
        if self.opsm_delta != 1e-4 and not self.use_opsm:
            raise ConfigError("--opsm-delta sets the threshold of --use-opsm; add --use-opsm or remove it")
        if self.true_on_policy_mode:
            self.deterministic_expert_routing = True  # the same batch-invariant kernels
        if self.r3_buffer_size is not None and not self.use_r3:
            raise ConfigError(
                "--r3-buffer-size bounds the routing records kept for replay; add --use-r3 or remove it"
            )


@dataclass
class TrainSection:
    """The optimizer and the batch layout."""

    lr: float = option(1e-6, "learning rate", bounds="(0, inf)")
    min_lr: float = option(0.0, "final learning rate of the cosine decay", bounds="[0, inf)")
    lr_decay_style: str = option("constant", "constant | cosine", choices=("constant", "cosine"))
    warmup_steps: int = option(0, "linear LR warm-up steps", aliases=("lr_warmup_iters",), bounds="[0, inf)")
    warmup_precision: str | None = option(
        None,
        "with FP8 or INT4: the quantized layers of trainer and engine compute in bf16 for the first --warmup-steps "
        "rollouts, then in FP8/INT4 (the same --warmup-steps also warms up the learning rate)",
        choices=("bf16",),
    )
    weight_decay: float = option(0.0, "AdamW weight decay", bounds="[0, inf)")
    adam_beta1: float = option(0.9, "AdamW beta1", bounds="[0, 1)")
    adam_beta2: float = option(0.98, "AdamW beta2", bounds="[0, 1)")
    clip_grad: float = option(1.0, "gradient-norm clip (0: off)", bounds="[0, inf)")
    global_batch_size: int | None = option(
        None,
        "samples per optimizer step (default: rollout_batch_size x n_samples_per_prompt / num_steps_per_rollout)",
        bounds="[1, inf)",
    )
    micro_batch_size: int = option(
        64, "samples per forward/backward (gradient accumulation up to the global batch)", bounds="[1, inf)"
    )
    use_dynamic_batch_size: bool = option(
        False,
        "cut micro-batches by tokens, not samples: samples sorted by length, each micro-batch filled while "
        "rows x longest <= --max-tokens-per-gpu; ranks get token-balanced shares (replaces --micro-batch-size)",
    )
    max_tokens_per_gpu: int | None = option(
        None, "with --use-dynamic-batch-size: padded tokens per micro-batch on one rank", bounds="[1, inf)"
    )
    recompute_activations: bool = option(
        False,
        "activation recomputation: keep each decoder layer's input only and recompute the layer in backward "
        "(less memory for activations, the time of one more forward)",
    )
    optimizer_cpu_offload: bool = option(
        False,
        "keep AdamW's state in host memory and step there (GPU runs: frees twice the weights' bytes on the "
        "device; a CPU run already holds it there, so nothing changes)",
    )
    auto_batch: bool = option(
        False,
        "size micro-batches by memory: the first steps measure peak memory against tokens per micro-batch and "
        "the run keeps the largest --max-tokens-per-gpu that fits --memory-budget-gb (implies "
        "--use-dynamic-batch-size)",
    )
    memory_budget_gb: float | None = option(
        None,
        "with --auto-batch: the training process's peak memory to stay under (host RSS on CPU, allocated CUDA "
        "memory on a GPU)",
        bounds="(0, inf)",
    )
    max_consecutive_skipped_steps: int = option(
        5,
        "stop the run when this many optimizer steps in a row were skipped for a non-finite loss or gradient "
        "(NaN weights, a diverged run); 0: never stop",
        bounds="[0, inf)",
    )
    num_steps_per_rollout: int = option(1, "optimizer steps per rollout", bounds="[1, inf)")
    data_parallel: str = option(
        "ddp",
        "with several training ranks: ddp (every rank holds the whole model; one gradient all-reduce per "
        "step) or fsdp (FSDP2 fully_shard: weights, gradients and optimizer state sharded over the ranks)",
        choices=("ddp", "fsdp"),
    )
    share_prompts: bool = option(
        True,
        "compute each group's shared prompt once in the training forward (same result as the full "
        "forward to fp32 rounding; --no-share-prompts runs every sample in full)",
    )
    skip_zero_advantage: bool = option(
        True,
        "train without the samples whose advantage is 0 at every trained token (a GRPO group of equal "
        "rewards): they add no gradient and the loss keeps the whole batch's denominator, so the update is "
        "the same. Off where an entropy, KL or aux-loss term reads them, under FSDP or expert parallelism",
    )
    pad_free: bool = option(
        True,
        "training forwards run every projection and MLP on the real tokens alone, one GEMM over all of a "
        "micro-batch's tokens, and pad only around attention (same result to fp32 rounding; not with FSDP, "
        "expert parallelism, expert capacity or deterministic routing, where every forward's shape must agree)",
    )
    seed: int = option(1234, "training seed (data order, init)", bounds="[0, inf)")
    aux_loss_coef: float = option(
        0.0,
        "MoE load-balancing loss weight: coef * E * sum_i f_i * P_i per MoE layer, averaged over layers (Megatron's "
        "form; Hugging Face's Qwen-MoE loss is top_k times it); 0.01 is a usual remedy for a collapsed router",
        aliases=("moe_aux_loss_coeff",),
        bounds="[0, inf)",
    )
    moe_aux_loss_type: str = option(
        "micro_batch",
        "where the load fractions f_i of the aux loss are counted: micro_batch (each forward's tokens, Megatron's "
        "aux_loss) or global (summed over every micro-batch and rank of the optimizer step so far, Qwen's "
        "global-batch balance)",
        choices=("micro_batch", "global"),
    )
    moe_capacity_factor: float | None = option(
        None,
        "expert capacity: each expert takes at most ceil(tokens * top_k / experts * F) slots per forward, the rest "
        "are dropped (the residual carries the token); in trainer and engines alike, and replayed by --use-r3 "
        "(unset: dropless)",
        aliases=("moe_expert_capacity_factor",),
        bounds="(0, inf)",
    )
    moe_token_drop_policy: str = option(
        "probs",
        "which slots an over-capacity expert keeps: probs (its highest router probabilities) or position (the "
        "earliest tokens)",
        choices=("probs", "position"),
    )
    expert_model_parallel_size: int = option(
        1,
        "expert parallelism: the MoE experts are split over N training ranks (tokens exchanged by all-to-all), "
        "data parallelism over the ranks; needs N to divide the training ranks and the experts",
        bounds="[1, inf)",
    )
    offload_experts: bool = option(
        False,
        "expert weights, gradients and optimizer state stay in host memory; each MoE layer's experts are brought "
        "to the device for its forward and again for its backward (recomputed), one layer at a time",
    )

    def micro_samples(self, world: int = 1) -> int:
        """Samples per forward/backward on one of `world` data-parallel ranks: --micro-batch-size,
        at most the rank's share of the global batch (the policy trainer and the critic alike)."""
        return min(self.micro_batch_size, self.global_batch_size // world)

    def check(self) -> None:
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.expert_model_parallel_size > 1 and self.data_parallel == "fsdp":
            raise ConfigError(
                "--expert-model-parallel-size with --data-parallel fsdp: FSDP already shards the experts; use one of them"
            )
        if self.offload_experts and self.data_parallel == "fsdp":
            raise ConfigError(
                "--offload-experts with --data-parallel fsdp: FSDP2 owns the parameters' placement; use ddp"
            )
        if self.optimizer_cpu_offload and self.data_parallel == "fsdp":
            raise ConfigError(
                "--optimizer-cpu-offload with --data-parallel fsdp: FSDP2 owns the sharded parameters and their "
                "optimizer state; use --data-parallel ddp"
            )
        if self.auto_batch != (self.memory_budget_gb is not None):
            raise ConfigError(
                "--auto-batch and --memory-budget-gb go together: the run sizes its micro-batches to that budget"
            )
        if self.auto_batch:
            self.use_dynamic_batch_size = True
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None and not self.auto_batch:
            raise ConfigError(
                "--use-dynamic-batch-size needs --max-tokens-per-gpu N (padded tokens per micro-batch), or "
                "--auto-batch --memory-budget-gb G to find N"
            )
        if self.max_tokens_per_gpu is not None and not self.use_dynamic_batch_size:
            raise ConfigError(
                "--max-tokens-per-gpu sizes the micro-batches of --use-dynamic-batch-size; add it (or use "
                "--micro-batch-size)"
            )


@dataclass
class CheckpointSection:
    """Saving and resuming."""

    save: str | None = option(
        None, "directory for checkpoints (model, optimizer, scheduler, RNG, data position)"
    )
    load: str | None = option(
        None,
        "checkpoint directory to resume from (its latest complete checkpoint); a missing or empty directory is "
        "an error unless --resume-if-present",
    )
    resume_if_present: bool = option(
        False,
        "with --load: start from scratch when the directory has no checkpoint yet, resume when it has one (a "
        "preemptible job restarted with the same command, e.g. --save ckpt --load ckpt --resume-if-present)",
    )
    save_interval: int = option(0, "save every N rollouts (0: only at the end)", bounds="[0, inf)")
    save_hf: str | None = option(None, "export the final policy as a Hugging Face checkpoint here")

    def check(self) -> None:
        for flag, value in (("--save", self.save), ("--save-hf", self.save_hf)):
            _directory_or_absent(flag, value)
        if self.save_interval and not self.save:
            raise ConfigError(
                "--save-interval says how often to write checkpoints; add --save DIR to say where"
            )
        if self.resume_if_present and not self.load:
            raise ConfigError(
                "--resume-if-present resumes from --load when it holds a checkpoint; add --load DIR (usually the "
                "same directory as --save)"
            )
        if self.load and not self.resume_if_present:
            if not Path(self.load).is_dir():
                raise ConfigError(
                    f"--load {self.load}: no such directory. To start from scratch when no checkpoint exists yet "
                    "(a preemptible job that resumes itself), add --resume-if-present"
                )
            if not (Path(self.load) / "latest").exists():
                raise ConfigError(
                    f"--load {self.load}: holds no checkpoint (no 'latest' file written by --save). To start from "
                    "scratch when none exists yet, add --resume-if-present"
                )


@dataclass
class LoggingSection:
    """Where results go and how loud."""

    output_dir: str | None = option(None, "run directory for metrics.jsonl and plots (default: runs/<time>)")
    use_tensorboard: bool = option(False, "also write TensorBoard event files")
    use_wandb: bool = option(False, "also log to Weights & Biases (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = option("miles", "wandb project")
    log_level: str = option(
        "INFO",
        "DEBUG | INFO | WARNING (MILES_DEBUG=1 means DEBUG)",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    progress: bool = option(True, "show a progress display")
    profile: bool = option(
        False,
        "record a torch.profiler trace of RL steps 2-3 (after one warm-up step), phases marked miles.rollout / "
        "miles.train / miles.sync: trace.json for Perfetto or chrome://tracing, and summary.txt, the top operators",
    )
    profile_dir: str | None = option(None, "where --profile writes (default: <run dir>/profile)")

    def check(self) -> None:
        """Its own rules; MILES_DEBUG implies DEBUG, --profile-dir implies --profile."""
        for flag, value in (("--output-dir", self.output_dir), ("--profile-dir", self.profile_dir)):
            _directory_or_absent(flag, value)
        if env_switch("MILES_DEBUG") == "1":
            self.log_level = "DEBUG"
        if self.profile_dir:
            self.profile = True  # asking where profiles go asks for one


@dataclass
class PrecisionSection:
    """Low precision (FP8 / INT4). At most one of the two per run."""

    fp8_recipe: str | None = option(
        None,
        "unified FP8: trainer and rollout engine quantize the same way. blockwise: a scale per 128x128 weight "
        "block and 1x128 activation tile | tensorwise: one per tensor | delayed: per tensor from an amax history "
        "(Transformer Engine's). Power-of-two scales unless NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1",
        choices=("blockwise", "tensorwise", "delayed"),
    )
    fp8_format: str | None = option(
        None,
        "e4m3 (every FP8 tensor E4M3, the default) | hybrid (E4M3 forward, E5M2 for gradients in the backward)",
        choices=("e4m3", "hybrid"),
    )
    fp8_dynamic_scaling: bool = option(
        False,
        "with --fp8-recipe delayed: scale each tensor by its own current amax instead of the history (blockwise "
        "and tensorwise always do; there the flag changes nothing and is refused)",
    )
    fp8_rollout_only: bool = option(
        False,
        "FP8 in the rollout engine only (--fp8-recipe, default blockwise), the trainer in full precision: the "
        "train/rollout mismatch low-precision inference brings, which unified FP8 removes and --use-tis corrects",
    )
    fp8_fp32_scales: bool = option(
        False,
        "FP8 scales in FP32 instead of powers of two; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 sets it (read once in "
        "the driver, carried to every Ray worker in the configuration)",
    )
    fp8_skip_layers: str | None = option(
        None,
        'comma-separated name patterns kept in full precision, e.g. "lm_head,embed" (embeddings, lm_head, '
        "norms and the MoE router always are); a pattern matching no layer is an error",
    )
    int4_qat: bool = option(
        False,
        "INT4 quantization-aware training (W4A16): the trainer uses weights rounded to INT4 (a scale per input "
        "group, straight-through backward) and the engine serves the same grid packed. Projections only; "
        "embeddings, lm_head, norms and routers stay full precision. OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 sets it",
    )
    int4_rollout_only: bool = option(
        False,
        "packed INT4 weights in the rollout engine only, the trainer in full precision: the train/rollout "
        "mismatch INT4 serving without QAT brings (and training memory is not reduced)",
    )
    int4_group_size: int | None = option(
        None,
        "INT4 group size G (default 128): inputs per scale. It must divide the input size of every quantized layer "
        "(checked at start-up); smaller groups track the weights closer, larger ones store fewer scales. "
        "OPEN_TRAINING_INT4_GROUP_SIZE sets it",
        bounds="[1, inf)",
    )
    int4_skip_layers: str | None = option(
        None,
        'comma-separated name patterns kept in full precision, e.g. "o_proj,down_proj" or "layers.0." '
        "(embeddings, lm_head, norms and the MoE router always are); a pattern matching no layer is an error",
    )
    int4_kernel_activations: str = option(
        "fp32",
        "activations of the INT4 engine: fp32 (the codes dequantized as they are read: on CPU inside the "
        "fused decode step, elsewhere per layer into one fp32 matmul; the fp32 model on the grid weights) | "
        "bf16 (torch's INT4 kernel with 16-bit activations, as GPU W4A16 serving runs it; adds bf16 rounding "
        "to the train/rollout mismatch)",
        choices=("fp32", "bf16"),
    )


@dataclass
class SpeculativeSection:
    """Speculative rollout: a draft proposes tokens, the policy verifies them (exact sampling)."""

    draft_model: str | None = option(
        None,
        "speculative rollout's draft: eagle (a small block over the policy's hidden state; train it with "
        "--online-sft-interval) | auto (the policy's first --draft-layers blocks) | ngram (recent matches; no "
        "model) | a checkpoint | none (off, with the YAML's draft settings). Tokens follow the policy exactly",
    )
    draft_layers: int = option(
        1, "with --draft-model auto: how many of the policy's blocks the draft keeps", bounds="[1, inf)"
    )
    draft_vocab_size: int = option(
        4096,
        "with --draft-model eagle: the draft proposes only the policy's N most sampled tokens (reading all "
        "of lm_head per draft token costs a large share of a policy pass); 0: the whole vocabulary",
        bounds="[0, inf)",
    )
    eagle_head: str | None = option(
        None,
        "with --draft-model eagle: start from a head saved by `miles draft` (trained on the policy's own "
        "samples of the run's prompts) instead of an untrained one, so speculation pays from the first rollout",
    )
    spec_lookahead: int = option(
        5,
        "draft tokens proposed per policy pass (k); with --spec-adaptive the most it proposes",
        bounds="[1, inf)",
    )
    spec_max_batch_size: int = option(
        16,
        "speculation runs while at most this many requests decode; above it one policy pass per token is "
        "cheaper than verifying k proposals for every row",
        bounds="[1, inf)",
    )
    spec_adaptive: bool = option(
        True,
        "below --spec-max-batch-size, decode with the lookahead (plain, 1, 2, 3 or k) of most tokens/s at the "
        "batch size: the draft's measured acceptance by position over each lookahead's timed pass; "
        "--no-spec-adaptive speculates k tokens on every step",
    )
    online_sft_interval: int = option(
        0,
        "every N RL steps, train the draft on the latest rollouts (next-token cross-entropy on the policy's "
        "samples; eagle: the policy's distribution and hidden state at each next position; the policy is "
        "untouched) and send it to the engines; 0: a frozen draft",
        bounds="[0, inf)",
    )
    draft_lr: float = option(1e-3, "learning rate of the draft's online training (AdamW)", bounds="(0, inf)")
    draft_ema_decay: float | None = option(
        None, "keep an EMA of the draft's weights with this decay and serve the EMA", bounds="[0, 1)"
    )
    reinit_draft_interval: int = option(
        0,
        "every N RL steps, rebuild the draft from the current policy (auto) or its checkpoint; 0: never",
        bounds="[0, inf)",
    )
    profile_speculative: bool = option(
        False,
        "log a table per step: acceptance by draft position, tokens per policy pass, draft/verify time, and "
        "the lookahead that would maximise throughput at the measured acceptance",
    )


@dataclass
class SyncSection:
    """Moving weights from the trainer to the rollout engine."""

    colocate: bool = option(
        False,
        "training ranks and rollout engines share devices (one engine per training device, in the same placement-group "
        "bundle); they take turns and engines free their KV cache while training runs. The local one-process "
        "executor is colocated anyway; there the flag only frees the KV cache between rollouts",
    )
    sync_bucket_size: int = option(
        512 * 1024**2,
        "bytes per weight-sync bucket",
        aliases=("update_weight_buffer_size",),
        bounds="[1, inf)",
    )
    use_zero_copy_sync: bool = option(
        False,
        "engines on this host map the trainer's weights (shared memory on CPU) instead of receiving bytes; falls back to bucketed sync, with one warning, where they cannot",
    )
    sync_transport: str = option(
        "auto",
        "how weights reach Ray rollout engines: object-store (buckets put once, read by every engine) | "
        "broadcast (rank 0 broadcasts buckets over a weight-update group: gloo on CPU, NCCL on GPU) | auto "
        "(broadcast on GPUs, object-store on CPU). --use-zero-copy-sync takes precedence on one host",
        choices=("auto", "object-store", "broadcast"),
    )
    delta_sync: bool = option(
        False,
        "send only what changed since each engine's version: the XOR of every tensor's bits with the last "
        "version's, zstd-compressed, checksummed; a refused delta (wrong version, bad checksum) is followed by "
        "a full version. Ray engines, over the object store or the weight-update group (--sync-transport)",
    )
    async_weight_sync: bool = option(
        False,
        "one-step off-policy: rollout N+1 runs while step N trains, and step N's weights land in the engine at a "
        "decoding-step boundary of rollout N+1 (versions tracked per sample)",
    )
    rollout_mode: str = option(
        "sync",
        "sync | fully-async: the engines keep generating while the trainer trains; each version lands between "
        "decoding steps and unfinished responses continue under it; a prompt starts only if it can train within "
        "--max-staleness versions, finished groups train oldest first (needs --use-tis or --use-opsm)",
        choices=("sync", "fully-async"),
    )
    max_staleness: int | None = option(
        None,
        "how many weight versions a trained sample may lag the trainer: with --rollout-mode fully-async the bound "
        "admission control keeps (default 2); with --async-weight-sync the bound --drop-stale enforces (default 1)",
        bounds="[0, inf)",
    )
    drop_stale: bool = option(
        False,
        "discard groups staler than --max-staleness instead of pacing the engines. Biased: long responses are the "
        "ones that go stale, so training drifts toward short, easy problems, and a problem slower than the bound is "
        "never trained on (the doctor's length-drift check shows it)",
    )
    allow_uncorrected_async: bool = option(
        False,
        "accept an async run with no off-policy correction (no --use-tis / --use-opsm): the ratio to the rollout "
        "policy goes uncorrected, which can collapse training",
    )
    update_weights_interval: int = option(1, "push weights to the engine every N rollouts", bounds="[1, inf)")
    check_weight_update_equal: bool = option(
        False, "after each push, compare engine and trainer weights by checksum"
    )
    actor_num_nodes: int = option(
        1,
        "training nodes; ranks = nodes x --actor-num-gpus-per-node, packed into one Ray placement group",
        bounds="[1, inf)",
    )
    actor_num_gpus_per_node: int = option(
        1,
        "training ranks per node (GPUs; on CPU, processes); > 1 runs on Ray + torch.distributed",
        bounds="[1, inf)",
    )
    rollout_num_gpus: int | None = option(
        None,
        "devices for rollout engines (on CPU: engine processes); > 1 runs engines as Ray actors",
        bounds="[1, inf)",
    )
    rollout_num_gpus_per_engine: int = option(
        1,
        "devices per rollout engine: > 1 splits each engine's model tensor-parallel over that many processes "
        "(attention heads and MLP/expert inner sizes must divide by it); engines = --rollout-num-gpus / this",
        bounds="[1, inf)",
    )

    @property
    def training_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def check(self) -> None:
        fully_async = self.rollout_mode == "fully-async"
        if not (self.async_weight_sync or fully_async):
            for flag, given in (
                ("--max-staleness", self.max_staleness is not None),
                ("--drop-stale", self.drop_stale),
                ("--allow-uncorrected-async", self.allow_uncorrected_async),
            ):
                if given:
                    raise ConfigError(
                        f"{flag} applies to async rollouts; add --rollout-mode fully-async or --async-weight-sync, "
                        "or remove it"
                    )
        if fully_async and self.async_weight_sync:
            raise ConfigError(
                "--rollout-mode fully-async already overlaps rollout and training (and lands each version in "
                "flight); drop --async-weight-sync"
            )
        if self.max_staleness is None and (fully_async or self.async_weight_sync):
            self.max_staleness = 2 if fully_async else 1
        if self.async_weight_sync and self.max_staleness < 1:
            raise ConfigError(
                "--max-staleness must be >= 1 with --async-weight-sync (rollout N+1 is one step behind)"
            )
        if fully_async and self.max_staleness < 1:
            raise ConfigError(
                "--max-staleness must be >= 1 with --rollout-mode fully-async (the engines generate the next "
                "batch with weights one version behind the trainer)"
            )
        if fully_async and self.colocate:
            raise ConfigError(
                "--colocate with --rollout-mode fully-async: colocated rollout and training take turns on the same "
                "devices, so they cannot overlap; drop one of them"
            )
        if (self.rollout_num_gpus or 1) % self.rollout_num_gpus_per_engine:
            raise ConfigError(
                f"--rollout-num-gpus ({self.rollout_num_gpus or 1}) must be a multiple of --rollout-num-gpus-per-engine "
                f"({self.rollout_num_gpus_per_engine}): each engine takes that many devices"
            )
        if self.colocate and self.async_weight_sync:
            raise ConfigError(
                "--colocate with --async-weight-sync: colocated rollout and training take turns on the same devices, "
                "so rollout N+1 cannot overlap training N; drop one of them"
            )
        world = self.training_ranks
        if self.colocate and world > 1 and (self.rollout_num_gpus or 1) != world:
            raise ConfigError(
                f"--colocate runs one engine on each training device: --rollout-num-gpus must be {world} "
                "(--actor-num-nodes x --actor-num-gpus-per-node)"
            )


@dataclass
class CoEvolutionSection:
    """Several policies trained together in multi-turn episodes (YAML section `co_evolution:`)."""

    env_path: str | None = option(
        None,
        "the multi-agent environment: kuhn_poker or proposer_solver (built in), or module:Class (see "
        "miles/multiagent/episodes.py); each agent gets its own copy of --model, optimizer, engine and checkpoint",
        aliases=("env",),
    )
    strategy: str = option(
        "simultaneous",
        "simultaneous: every agent trains every step; alternating: one agent trains for --co-evolution-interval "
        "steps while the others are frozen, then the next",
        choices=("simultaneous", "alternating"),
    )
    population_size: int | None = option(
        None,
        "fictitious self-play: keep each agent's last K snapshots (one every --co-evolution-interval steps) and "
        "play a training agent against a snapshot of each opponent drawn at random (unset: the current opponents)",
        bounds="[1, inf)",
    )
    co_evolution_interval: int = option(
        20,
        "steps between strategy switches (alternating) and between snapshots (population)",
        bounds="[1, inf)",
    )
    episodes_per_step: int = option(64, "episodes each training agent plays per step", bounds="[1, inf)")
    role_baseline_decay: float = option(
        0.9,
        "per-role baseline: each agent's advantage is its reward minus a moving average of its own rewards "
        "(in zero-sum play the group mean of GRPO is ~0 and useless)",
        bounds="[0, 1)",
    )
    agent_overrides: dict = option(
        {},
        "per-agent trainer settings, e.g. {proposer: {use_kl_loss: true, kl_loss_coef: 0.5}, solver: {lr: 1e-4}}: "
        "keys of the train: and algo: sections (a YAML mapping, or JSON on the command line)",
    )
    magnet_kl_coef: float | None = option(
        None,
        "KL pull of each agent towards its own policy at the last --co-evolution-interval boundary, a reference "
        "that moves with it (an agent with --use-kl-loss keeps that fixed pull). Default: 0.5 with --strategy "
        "alternating or --population-size, which need it; 0 for plain simultaneous updates",
        bounds="[0, inf)",
    )
    action_warmup_steps: int = option(
        50,
        "before RL, steps of supervised warm-up that spread each agent's first move over the environment's "
        "action tokens (when it names them), so the policies start near uniform",
        bounds="[0, inf)",
    )


@dataclass
class DebugSection:
    """Split the system to find a problem."""

    debug_rollout_only: bool = option(False, "generate and score, never train")
    debug_blank_images: bool = option(
        False,
        "replace every prompt image by a white one of its size: the text-only baseline of a vision-language "
        "run, and what `miles doctor` names blind",
    )
    debug_train_only: bool = option(
        False,
        "train on the rollouts saved in --load-debug-rollout-data, with no engine (one process; no evaluation): "
        "reproduces the saving run's losses step for step",
    )
    save_debug_rollout_data: str | None = option(
        None,
        "write each rollout's scored samples to this path pattern, e.g. runs/x/rollout_{rollout_id}.pt "
        "(format in miles/rollout/debug_data.py)",
    )
    load_debug_rollout_data: str | None = option(
        None, "the --save-debug-rollout-data pattern a --debug-train-only run reads"
    )
    mismatch_dump_interval: int = option(
        0,
        "every N rollouts keep a few of its samples with the trainer's and the engine's weights in "
        "<run dir>/mismatch (the latest only), for `miles doctor --localize-mismatch RUN_DIR` (0: off)",
        bounds="[0, inf)",
    )
    mismatch_dump_samples: int = option(
        4, "samples each --mismatch-dump-interval dump keeps", bounds="[1, inf)"
    )
    fault_inject: list = option(
        [],
        "kill a part of the job on purpose to test recovery, as TARGET@POINT:ROLLOUT (repeatable): TARGET driver, "
        "engine, rank or reward; POINT rollout, step, sync or checkpoint; e.g. engine@rollout:3 (miles/runtime/faults.py)",
    )

    def check(self) -> None:
        if self.save_debug_rollout_data and "{rollout_id}" not in self.save_debug_rollout_data:
            raise ConfigError(
                f"--save-debug-rollout-data {self.save_debug_rollout_data}: the pattern needs {{rollout_id}}, "
                "e.g. runs/x/rollout_{rollout_id}.pt (one file per rollout)"
            )
        if self.debug_train_only != bool(self.load_debug_rollout_data):
            raise ConfigError(
                "--debug-train-only and --load-debug-rollout-data go together: the train-only run reads the saved "
                "rollouts from that pattern"
            )
        if self.debug_train_only and self.debug_rollout_only:
            raise ConfigError("--debug-train-only and --debug-rollout-only exclude each other")
        from miles.faults import parse_fault

        for spec in self.fault_inject:
            parse_fault(spec)
        if self.mismatch_dump_samples != 4 and not self.mismatch_dump_interval:
            raise ConfigError(
                "--mismatch-dump-samples sizes the dumps of --mismatch-dump-interval; add --mismatch-dump-interval N"
            )


@dataclass
class SGLangSection:
    """Rollout on external SGLang servers (YAML section `sglang:`; see docs/rollout.md)."""

    rollout_backend: str = option(
        "miles",
        "miles: the built-in engine (in this process or as Ray actors); sglang: SGLang servers (or `miles serve`) "
        "at --sglang-url, through their native /generate and /update_weights_from_disk",
        choices=("miles", "sglang"),
    )
    sglang_url: str | None = option(
        None,
        "with --rollout-backend sglang: the servers' base URLs, comma-separated (a router's URL is one server)",
    )
    sglang_max_concurrency: int = option(32, "requests in flight to the servers at once", bounds="[1, inf)")
    sglang_retries: int = option(
        3,
        "tries per server for a request that meets a connection error or a 5xx (backoff doubles)",
        bounds="[1, inf)",
    )
    sglang_request_timeout: float = option(600.0, "seconds to wait for one response", bounds="(0, inf)")
    sglang_weight_transport: str = option(
        "disk",
        "how weights reach the servers: disk (a checkpoint in --sglang-weight-dir, then /update_weights_from_disk) "
        "or distributed (SGLang's weight-update group: NCCL from a GPU trainer, gloo from a CPU one)",
        choices=("disk", "distributed"),
    )
    sglang_master_address: str | None = option(
        None,
        "with --sglang-weight-transport distributed: this host's address as the servers reach it (default: the "
        "address it reaches the first server from)",
    )
    sglang_weight_dir: str | None = option(
        None,
        "where the trainer writes the weights each server loads (default RUN_DIR/sglang_weights); the servers must "
        "be able to read it (same host or a shared filesystem)",
    )


@dataclass
class LoraSection:
    """LoRA: train low-rank adapters over a frozen base; only the adapters travel to the engines."""

    lora_rank: int = option(
        0,
        "adapter rank r (0: full fine-tuning); the base stays frozen and holds no gradients or optimizer state",
        bounds="[0, inf)",
    )
    lora_alpha: float | None = option(
        None, "adapters scale by alpha / r (default: alpha = twice the rank)", bounds="(0, inf)"
    )
    lora_dropout: float = option(0.0, "dropout on the adapters' input while training", bounds="[0, 1)")
    lora_target_modules: str = option(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "comma-separated layer names to adapt (a name matches itself and every module ending in it, as in PEFT: "
        "gate_proj covers MoE experts and the shared expert), or all-linear",
        aliases=("target_modules",),
    )
    lora_adapter_path: str | None = option(
        None,
        "start from this PEFT adapter directory (adapter_config.json + adapter_model.safetensors); its rank, "
        "alpha and layers are used",
    )
    check_lora_weight_equal: bool = option(
        False, "after each sync, read every engine's served adapter back and compare it with the trainer's"
    )
    lora_merge_on_export: bool = option(
        False, "--save-hf writes the merged model (base + adapter) instead of the PEFT adapter"
    )

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0 or self.lora_adapter_path is not None

    def check(self) -> None:
        if not self.enabled:
            changed = [
                flag
                for flag, on in (
                    ("--lora-alpha", self.lora_alpha is not None),
                    ("--lora-dropout", self.lora_dropout != 0.0),
                    ("--check-lora-weight-equal", self.check_lora_weight_equal),
                    ("--lora-merge-on-export", self.lora_merge_on_export),
                )  # fmt: skip
                if on
            ]
            if changed:
                raise ConfigError(
                    f"{changed[0]} configures LoRA; add --lora-rank R (or --lora-adapter-path DIR)"
                )
        if self.lora_adapter_path is not None and not Path(self.lora_adapter_path).is_dir():
            raise ConfigError(
                f"--lora-adapter-path {self.lora_adapter_path}: no such directory; give a PEFT adapter directory "
                "(adapter_config.json + adapter_model.safetensors)"
            )


@dataclass
class AgentSection:
    """Multi-turn agent rollouts: tools the policy calls, a custom generate function, or a black-box
    agent over an OpenAI-compatible API (one of the three). See docs/agents.md."""

    tool_path: list = option(
        [],
        "a tool the policy may call: module:function (schema from its type hints and docstring, or its `schema` "
        "attribute) or a built-in (calculator, python); repeat the flag for more tools",
    )
    tool_call_parser: str = option(
        "hermes",
        "how tool calls are read from the policy's text: hermes (<tool_call>{json}</tool_call>, the format of HF "
        "chat templates with tools) or module:function returning ToolCall/CallError lists",
    )
    max_turns: int = option(
        4, "policy turns per conversation (the last may not call a tool)", bounds="[1, inf)"
    )
    max_tool_calls: int = option(
        8, "tool calls per conversation; calls past it get an error result", bounds="[0, inf)"
    )
    max_turn_tokens: int | None = option(
        None,
        "tokens one policy turn may generate (default: what is left of --rollout-max-response-len, which "
        "covers the whole conversation after the prompt, tool results included)",
        bounds="[1, inf)",
    )
    tool_timeout: float = option(
        10.0, "seconds one tool call may take before its worker is killed", bounds="(0, inf)"
    )
    tool_cpu_seconds: float = option(
        10.0, "CPU seconds one tool call may use (0: no limit)", bounds="[0, inf)"
    )
    tool_memory_mb: int = option(
        1024,
        "memory one tool call may allocate beyond its worker's own, in MiB (0: no limit)",
        bounds="[0, inf)",
    )
    tool_file_mb: int = option(16, "largest file a tool may write, in MiB (0: no limit)", bounds="[0, inf)")
    tool_num_workers: int = option(4, "sandboxed processes running tool calls in parallel", bounds="[1, inf)")
    custom_generate_function_path: str | None = option(
        None,
        "module:function(sample, client, params) -> Sample generating one sample its own way (client.generate "
        "(ids, params) returns the engine's tokens and log-probs); the sample's tokens, loss_mask and "
        "rollout_log_probs are trained on as returned",
    )
    agent_path: str | None = option(
        None,
        "module:function(base_url, sample) running a black-box agent with the openai client pointed at base_url; "
        "every completion it asks for is recorded as tokens and trained on. It returns a reward (number), the "
        "final answer (text) or None (the last assistant message is scored)",
    )

    @property
    def mode_flag(self) -> str | None:
        """The flag that turns the multi-turn mode on (None: single-turn rollouts)."""
        given = [
            flag
            for flag, on in (
                ("--tool-path", bool(self.tool_path)),
                ("--custom-generate-function-path", self.custom_generate_function_path),
                ("--agent-path", self.agent_path),
            )  # fmt: skip
            if on
        ]
        if len(given) > 1:
            raise ConfigError(f"{given[0]} and {given[1]} are two rollout modes; give one")
        return given[0] if given else None

    def check(self) -> None:
        self.mode_flag  # noqa: B018 - raises on two modes at once


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    sync: SyncSection = field(default_factory=SyncSection)
    co_evolution: CoEvolutionSection = field(default_factory=CoEvolutionSection)
    sglang: SGLangSection = field(default_factory=SGLangSection)
    debug: DebugSection = field(default_factory=DebugSection)
    lora: LoraSection = field(default_factory=LoraSection)
    agent: AgentSection = field(default_factory=AgentSection)
