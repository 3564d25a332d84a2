"""Preference learning: the DPO and IPO losses against hand computations, and `miles dpo` on pairs
built from the default task and on a TRL-format file."""

from __future__ import annotations

import json
import math

import pytest
import torch

from miles.algo.preference import preference_loss, sequence_logps
from miles.errors import ConfigError


def test_dpo_and_ipo_losses_and_gradients_match_a_hand_computation():
    chosen = torch.tensor([-3.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-4.0, -2.0], requires_grad=True)
    ref_c, ref_r, beta = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -2.5]), 0.5
    h = [(-3.0 + 3.5) - (-4.0 + 3.0), (-5.0 + 4.0) - (-2.0 + 2.5)]  # 1.5, -1.5
    loss, metrics = preference_loss(chosen, rejected, ref_c, ref_r, beta, "sigmoid")
    want = sum(-math.log(1 / (1 + math.exp(-beta * x))) for x in h) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    loss.backward()
    d = [-beta / (1 + math.exp(beta * x)) / 2 for x in h]  # d/dh of -log sigmoid(beta h), over the batch mean
    assert chosen.grad.tolist() == pytest.approx(d, rel=1e-6) and rejected.grad.tolist() == pytest.approx(
        [-g for g in d]
    )
    assert metrics == pytest.approx(
        {"rewards/chosen": 0.5 * (0.5 - 1.0) / 2, "rewards/rejected": 0.5 * (-1.0 + 0.5) / 2,
         "rewards/margins": beta * (h[0] + h[1]) / 2, "rewards/accuracies": 0.5}
    )  # fmt: skip
    chosen.grad = rejected.grad = None
    loss, _ = preference_loss(chosen, rejected, ref_c, ref_r, beta, "ipo")
    assert loss.item() == pytest.approx(sum((x - 1 / (2 * beta)) ** 2 for x in h) / 2, rel=1e-6)
    loss.backward()
    assert chosen.grad.tolist() == pytest.approx([2 * (x - 1 / (2 * beta)) / 2 for x in h], rel=1e-6)
    logps, mask = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]), torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert sequence_logps(logps, mask, False).tolist() == [-5.0, -4.0]
    assert sequence_logps(logps, mask, True).tolist() == [-2.5, -4.0]


def test_dpo_on_the_default_task_pairs_learns_the_preference_and_logs_it(tmp_path):
    """12 steps on pairs built from the default job's problems (the answer chosen, a wrong number
    rejected): the implicit reward margin grows from 0 and the chosen answer wins most pairs;
    metrics.jsonl holds TRL's figures; the same with LoRA, whose reference is its base."""
    from miles.train.dpo import DPOConfig, run_dpo

    for lora, lr in ((0, 1e-4), (8, 2e-3)):  # LoRA's few weights take a larger step, as usual
        out = tmp_path / f"lora{lora}"
        run_dpo(DPOConfig(steps=12, batch_size=16, lr=lr, eval_size=0, output_dir=str(out), lora_rank=lora))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout"] for r in rows] == list(range(12))
        assert rows[0]["rewards/margins"] == pytest.approx(0, abs=1e-6)  # the policy is its reference
        late = rows[-4:]
        assert sum(r["rewards/margins"] for r in late) / 4 > 0.02, (
            lora,
            [r["rewards/margins"] for r in rows],
        )
        assert sum(r["rewards/accuracies"] for r in late) / 4 > 0.6, (
            lora,
            [r["rewards/accuracies"] for r in rows],
        )
        assert all(r["loss"] > 0 and "rewards/chosen" in r and "rewards/rejected" in r for r in rows)


def test_dpo_reads_trl_columns_and_names_a_file_without_them(tmp_path):
    from miles.train.dpo import DPOConfig, run_dpo

    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"What is {a} + {a}?", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(8)
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    result = run_dpo(
        DPOConfig(data=str(pairs), steps=3, batch_size=4, eval_size=0, output_dir=str(tmp_path / "o"))
    )
    assert result["steps"] == 3 and math.isnan(result["eval_accuracy"])
    pairs.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}))
    with pytest.raises(
        ConfigError, match="TRL's columns prompt, chosen, rejected; missing \\['chosen', 'rejected'\\]"
    ):
        run_dpo(DPOConfig(data=str(pairs), steps=1, output_dir=str(tmp_path / "p")))


def test_a_reward_model_learns_its_pairs_and_scores_a_run_as_it_scores_alone(tmp_path):
    """`miles rm` on 8 fixed pairs of a file fits them (every chosen answer scores higher); the
    saved HF checkpoint (*ForSequenceClassification, one label) loads back to the same scores; a
    1-step `miles train --rm-type model` gives each sample the reward model's score of its tokens
    and still counts accuracy by the task's own verdict."""
    from miles.config import load_config
    from miles.data.prompts import default_job_task_config, task_prompts
    from miles.data.sample import Sample
    from miles.diagnostics.metrics_file import read_metrics
    from miles.models import registry
    from miles.rewards.reward_model import ModelReward, load_reward_model, sequence_rewards
    from miles.rewards.runner import RewardRunner
    from miles.run import train
    from miles.train.dpo import file_pairs
    from miles.train.reward_training import RMConfig, pairwise_accuracy, run_rm
    from tests.conftest import small_run_args

    items, dataset = task_prompts("basic_arithmetic", 8, 3, default_job_task_config())
    rows = [{"prompt": i.prompt, "chosen": str(i.label), "rejected": str(int(i.label) + 3)} for i in items]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    save = tmp_path / "rm"
    run_rm(
        RMConfig(
            data=str(data),
            eval_size=0,
            steps=30,
            batch_size=8,
            output_dir=str(tmp_path / "o"),
            save=str(save),
        )
    )
    config = json.loads((save / "config.json").read_text())
    assert config["num_labels"] == 1 and config["architectures"][0].endswith("ForSequenceClassification")
    model = load_reward_model(save)
    _, tok = registry.load("tiny")
    assert pairwise_accuracy(model, file_pairs(str(data)), tok, chat=True) == 1.0
    sample = Sample(tokens=tok("What is 2 + 3? 5").input_ids)
    assert ModelReward(str(save)).score([sample]) == pytest.approx(
        sequence_rewards(model, [sample.tokens]).tolist()
    )
    with pytest.raises(ConfigError, match="not a reward model"):
        load_reward_model(registry.model_path("tiny"))

    out = tmp_path / "rl"
    cfg = load_config(
        small_run_args(out, 1) + ["--rm-type", "model", "--rm-path", str(save), "--eval-size", "0"]
    )
    runner = RewardRunner.from_config(cfg, dataset)
    assert isinstance(runner.model_reward, ModelReward)
    train(cfg)
    (step,) = read_metrics(out)
    assert 0 <= step["accuracy"] <= 1 and step["reward_mean"] not in (
        0.0,
        1.0,
    )  # a proxy score, a task verdict
    with pytest.raises(ConfigError, match="--rm-type model needs --rm-path"):
        load_config(small_run_args(out, 1) + ["--rm-type", "model"])

    # served (miles serve --model DIR finds a reward model there): --rm-type remote_rm gets the same scores
    from miles.models.tokenizer import encode_prompt
    from miles.rewards.remote import RemoteReward
    from miles.rewards.reward_model import is_reward_model
    from miles.serve.reward_server import RewardServer

    assert is_reward_model(save) and not is_reward_model(registry.model_path("tiny"))
    server = RewardServer(model, tok, port=0).start()
    try:
        asked = [Sample(prompt=r["prompt"], response=r["chosen"]) for r in rows[:3]]
        tokens = [
            encode_prompt(tok, s.prompt, True) + tok(s.response).input_ids + [tok.eos_token_id] for s in asked
        ]
        want = sequence_rewards(model, tokens).tolist()
        for batch in (1, 3):
            got = RemoteReward(server.url + "/reward", 30.0, batch_size=batch).map(asked)
            scores = [g["score"] if isinstance(g, dict) else g for g in got]
            assert scores == pytest.approx(want, abs=1e-5), batch
    finally:
        server.shutdown()
