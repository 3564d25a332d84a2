"""On-policy distillation: the advantage form by hand, the binned top-k KL against the full KL
and a hand count, the teacher's log-probs aligned with the sampled tokens (a teacher equal to
the student is 0 KL away in both forms), a teacher server equal to the loaded teacher, the flags
checked."""

from __future__ import annotations

import pytest
import torch

from miles.algo.distill import distill, topk_of, topk_reverse_kl
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


def test_the_binned_kl_is_the_full_kl_with_every_token_and_a_hand_count_with_one():
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 7), torch.randn(5, 7)
    p, q = torch.log_softmax(student / 0.7, -1), torch.log_softmax(teacher / 0.7, -1)
    full = (p.exp() * (p - q)).sum(-1)
    ids, values = topk_of(teacher, 7, 0.7)
    assert torch.allclose(topk_reverse_kl(student, ids, values, 0.7), full, atol=1e-6)
    # K = 1 over a vocabulary of 3: bins {teacher's likeliest token, the other two}
    s, t = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.1, 0.6, 0.3]])
    ids, values = topk_of(t.log(), 1, 1.0)
    assert ids.tolist() == [[1]]
    by_hand = 0.3 * torch.log(torch.tensor(0.3 / 0.6)) + 0.7 * torch.log(torch.tensor(0.7 / 0.4))
    assert topk_reverse_kl(s.log(), ids, values, 1.0).item() == pytest.approx(by_hand.item(), rel=1e-5)
    # every token gets a gradient, those outside the top-k through the rest's bin
    logits = torch.randn(3, 11, requires_grad=True)
    ids, values = topk_of(torch.randn(3, 11), 2, 1.0)
    topk_reverse_kl(logits, ids, values, 1.0).sum().backward()
    assert (logits.grad.abs() > 0).all()


def test_a_teacher_equal_to_the_student_is_zero_kl_away(tmp_path):
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    args = small_run_args(tmp_path, 1) + ["--use-opd", "--opd-teacher-load", "tiny", "--eval-size", "0"]
    train(load_config(args))
    step = read_metrics(tmp_path)[-1]
    # the teacher scores exactly the tokens the engine sampled (an off-by-one would show as nats)
    assert abs(step["opd_kl"]) < 1e-4 and step["train_rollout_logprob_abs_diff"] < 1e-5
    binned = ["--opd-type", "loss", "--opd-topk-per-position", "4", "--output-dir", str(tmp_path / "binned")]
    train(load_config(args + binned))
    step = read_metrics(tmp_path / "binned")[-1]
    assert abs(step["kl_loss"]) < 1e-6 and abs(step["opd_kl"]) < 1e-4  # the top-k at the sampled positions


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
    with pytest.raises(ConfigError, match="--opd-teacher-url with --opd-type loss.*--opd-topk-per-position"):
        load_config([*base, "--use-opd", "--opd-teacher-url", "http://127.0.0.1:1", "--opd-type", "loss"])
    with pytest.raises(ConfigError, match="--opd-topk-per-position shapes the loss form"):
        load_config([*base, "--use-opd", "--opd-teacher-load", "tiny", "--opd-topk-per-position", "4"])
    with pytest.raises(ConfigError, match="--opd-topk-per-position configures on-policy distillation"):
        load_config([*base, "--opd-topk-per-position", "4"])
    with pytest.raises(ConfigError, match="one process"):
        load_config([*base, "--use-opd", "--opd-teacher-load", "tiny", "--rollout-num-gpus", "2"])


def test_a_teacher_server_equals_the_teacher_beside_the_trainer(tmp_path):
    """--opd-teacher-url on a `miles serve` process of the teacher: the same steps, to fp32
    rounding, as --opd-teacher-load of that teacher (the server's prefill-only scores are the
    sampled tokens' log-probs). The teacher is a dense model, so no routing tie can differ
    between the trainer's batches and the server's single sequences."""
    from miles.diagnostics.metrics_file import read_metrics
    from miles.models.checkpoint import save_model
    from miles.models.tokenizer import byte_tokenizer
    from miles.run import train
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
        binned = flags + [
            "--opd-type",
            "loss",
            "--opd-topk-per-position",
            "5",
        ]  # the server's top_logprobs_num
        train(
            load_config(
                small_run_args(tmp_path / "local_k", 1) + binned + ["--opd-teacher-load", str(teacher)]
            )
        )
        train(load_config(small_run_args(tmp_path / "remote_k", 1) + binned + ["--opd-teacher-url", url]))
    finally:
        server.kill()
        server.wait()
    local, served = (
        comparable(read_metrics(tmp_path / "local")),
        comparable(read_metrics(tmp_path / "remote")),
    )
    assert len(local) == len(served) == 2 and local[-1]["opd_kl"] > 0.1  # a teacher far from the student
    local_k, served_k = (comparable(read_metrics(tmp_path / d)) for d in ("local_k", "remote_k"))
    assert local_k[-1]["kl_loss"] > 0.1
    for a, b in [*zip(local, served), *zip(local_k, served_k)]:
        for key, value in a.items():
            # the train/rollout gap is rounding itself (~1e-6): the two runs' differ by as much
            noise = 1e-5 if "rollout_train" in key or "train_rollout" in key else 1e-6
            assert b[key] == pytest.approx(value, rel=1e-5, abs=noise), key
