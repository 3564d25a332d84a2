"""On-policy distillation: the advantage form by hand, the teacher's log-probs aligned with the
sampled tokens (a teacher equal to the student is 0 KL away), the flags checked."""

from __future__ import annotations

import pytest
import torch

from miles.algo.distill import distill
from miles.config import load_config
from miles.data.sample import Sample
from miles.errors import ConfigError
from tests.conftest import DEFAULT_YAML, small_run_args


def test_the_advantage_form_subtracts_the_per_token_reverse_kl():
    samples = [
        Sample(tokens=[1, 2, 3, 4], response_length=2, rollout_log_probs=[-1.0, -2.0], loss_mask=[1, 1]),
        Sample(tokens=[1, 5, 6], response_length=2, rollout_log_probs=[-0.5, -0.1], loss_mask=[1, 0]),
    ]
    teacher = [torch.tensor([-1.5, -1.0]), torch.tensor([-0.5, -3.0])]
    advantages = [torch.tensor([1.0, 1.0]), torch.tensor([-1.0, -1.0])]
    out, metrics = distill(advantages, samples, teacher, 0.5, in_advantage=True)
    # k1 = log pi - log pi_T: [0.5, -1.0] and [0.0, 2.9]; the masked token does not count in the mean
    assert torch.allclose(out[0], torch.tensor([1.0 - 0.25, 1.0 + 0.5]))
    assert torch.allclose(out[1], torch.tensor([-1.0, -1.0 - 1.45]))
    assert metrics["opd_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    same, _ = distill(advantages, samples, teacher, 0.5, in_advantage=False)  # the loss form leaves them
    assert all(torch.equal(a, b) for a, b in zip(same, advantages))


def test_a_teacher_equal_to_the_student_is_zero_kl_away(tmp_path):
    from miles.runtime.loop import train
    from miles.runtime.metrics import read_metrics

    args = small_run_args(tmp_path, 1) + ["--use-opd", "--opd-teacher-load", "tiny", "--eval-size", "0"]
    train(load_config(args))
    step = read_metrics(tmp_path)[-1]
    # the teacher scores exactly the tokens the engine sampled (an off-by-one would show as nats)
    assert abs(step["opd_kl"]) < 1e-4 and step["train_rollout_logprob_abs_diff"] < 1e-5


def test_opd_flags_are_checked():
    base = ["--config", str(DEFAULT_YAML)]
    with pytest.raises(ConfigError, match="needs one teacher"):
        load_config([*base, "--use-opd"])
    with pytest.raises(ConfigError, match="add --use-opd"):
        load_config([*base, "--opd-teacher-load", "tiny"])
    with pytest.raises(ConfigError, match="--use-opd with --use-kl-loss"):
        load_config(
            [*base, "--use-opd", "--opd-teacher-load", "tiny", "--use-kl-loss", "--kl-loss-coef", "0.1"]
        )
    with pytest.raises(ConfigError, match="not both"):
        load_config(
            [*base, "--use-opd", "--opd-teacher-load", "tiny", "--opd-teacher-url", "http://127.0.0.1:1"]
        )
    with pytest.raises(ConfigError, match="--opd-teacher-url with --opd-type loss"):
        load_config([*base, "--use-opd", "--opd-teacher-url", "http://127.0.0.1:1", "--opd-type", "loss"])
    with pytest.raises(ConfigError, match="one process"):
        load_config([*base, "--use-opd", "--opd-teacher-load", "tiny", "--rollout-num-gpus", "2"])


def test_a_teacher_server_equals_the_teacher_beside_the_trainer(tmp_path):
    """--opd-teacher-url on a `miles serve` process of the teacher: the same steps, to fp32
    rounding, as --opd-teacher-load of that teacher (the server's prefill-only scores are the
    sampled tokens' log-probs). The teacher is a dense model, so no routing tie can differ
    between the trainer's batches and the server's single sequences."""
    from miles.models.checkpoint import save_model
    from miles.models.tokenizer import byte_tokenizer
    from miles.runtime.loop import train
    from miles.runtime.metrics import read_metrics
    from tests.conftest import comparable, random_model, start_server

    teacher = tmp_path / "teacher"
    save_model(random_model("llama", vocab_size=260), teacher, tokenizer=byte_tokenizer())
    server, url = start_server(model=str(teacher))
    try:
        flags = ["--use-opd", "--eval-size", "0", "--opd-kl-coef", "0.1"]
        train(
            load_config(small_run_args(tmp_path / "local", 2) + flags + ["--opd-teacher-load", str(teacher)])
        )
        train(load_config(small_run_args(tmp_path / "remote", 2) + flags + ["--opd-teacher-url", url]))
    finally:
        server.kill()
        server.wait()
    local, served = (
        comparable(read_metrics(tmp_path / "local")),
        comparable(read_metrics(tmp_path / "remote")),
    )
    assert len(local) == len(served) == 2 and local[-1]["opd_kl"] > 0.1  # a teacher far from the student
    for a, b in zip(local, served):
        for key, value in a.items():
            assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
