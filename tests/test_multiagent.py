"""Multi-agent RL: Kuhn Poker's exact exploitability, multi-turn loss masks, the co-evolution
strategies (alternating freezes the others bitwise) and population sampling."""

from __future__ import annotations

import copy
import random
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.models import registry
from miles.multiagent import kuhn
from miles.multiagent.episodes import play
from miles.rollout import Engine, SamplingParams
from tests.conftest import ROOT

EXAMPLES = ROOT / "examples"


def test_exploitability_of_uniform_and_of_the_nash_family():
    assert kuhn.exploitability(*kuhn.uniform()) == pytest.approx(11 / 12, abs=1e-12)
    for alpha in (0.0, 0.2, 1 / 3):
        p1, p2 = kuhn.nash(alpha)
        assert kuhn.exploitability(p1, p2) == pytest.approx(0.0, abs=1e-12)
        assert kuhn.game_value(p1, p2) == pytest.approx(-1 / 18, abs=1e-12)
    p1, p2 = kuhn.nash(0.0)
    p2 = dict(p2, **{"Q|b": 1.0})  # player 2 always calls with Q: player 1 gains by deviating
    assert kuhn.exploitability(p1, p2) > 0.01


policies = st.tuples(
    st.fixed_dictionaries({k: st.floats(0, 1) for k in kuhn.INFOSETS["player_1"]}),
    st.fixed_dictionaries({k: st.floats(0, 1) for k in kuhn.INFOSETS["player_2"]}),
)


@settings(max_examples=60, deadline=None)
@given(policies)
def test_best_response_is_at_least_every_pure_policy(pair):
    """The best response beats the policies' own value and every one of the 64 pure policies."""
    p1, p2 = pair
    v = kuhn.game_value(p1, p2)
    br1, br2 = kuhn.best_response_value(0, (p1, p2)), kuhn.best_response_value(1, (p1, p2))
    assert br1 >= v - 1e-12 and br2 >= -v - 1e-12
    keys = kuhn.INFOSETS["player_1"]
    for bits in range(64):
        pure = {k: float(bits >> i & 1) for i, k in enumerate(keys)}
        assert kuhn.game_value(pure, p2) <= br1 + 1e-12
    assert kuhn.exploitability(p1, p2) >= -1e-12


def test_average_policy_weights_by_own_reach():
    avg = kuhn.AveragePolicy("player_1")
    a = {k: 0.0 for k in kuhn.INFOSETS["player_1"]}  # always passes first: reaches "pb"
    b = dict(a, **{"K|": 1.0, "K|pb": 1.0})  # with K bets first: "K|pb" unreachable
    avg.add(a)
    avg.add(b)
    got = avg.policy()
    assert got["K|"] == 0.5
    assert got["K|pb"] == 0.0  # only a reaches it, and a folds there
    assert got["J|pb"] == 0.0


@pytest.fixture(scope="module")
def two_engines():
    from miles.multiagent.actions import warm_up_actions

    policy, tokenizer = registry.load("tiny")
    engines = {}
    for i, name in enumerate(kuhn.PLAYERS):
        model = copy.deepcopy(policy)
        torch.manual_seed(i)
        prompts = [kuhn.transcript(k) for k in kuhn.INFOSETS[name]]
        warm_up_actions(model, tokenizer, prompts, ("0", "1"), 12, 1e-3)  # both moves likely
        engines[name] = Engine(model.eval(), tokenizer, 64, seed=i)
    return engines, tokenizer


def test_each_agent_is_trained_on_exactly_its_own_tokens(two_engines):
    engines, tokenizer = two_engines
    env = kuhn.KuhnPoker(seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=1, ignore_eos=True)
    states, samples = play(env, engines, tokenizer, 48, params)
    assert len(samples["player_1"]) == len(samples["player_2"]) == 48  # both move in every deal
    histories = [s["history"] for s in states]
    assert {"pp", "bp", "bb", "pbp", "pbb"} & set(histories)
    assert any(len(h) == 3 for h in histories)  # some player 1 samples have two turns
    for agent, first in (("player_1", 0), ("player_2", 1)):
        for state, sample in zip(states, samples[agent]):
            history, card = state["history"], state["cards"][first]
            prompt = tokenizer.decode(sample.tokens[: sample.prompt_length])
            assert prompt == kuhn.view(history[:first], card)  # its own card only
            response = sample.tokens[sample.prompt_length :]
            own = [t for t, m in zip(response, sample.loss_mask) if m]
            seen = tokenizer.decode([t for t, m in zip(response, sample.loss_mask) if not m])
            mine = history[first::2][: len(own)]  # this player's moves, in order
            assert ["b" if tokenizer.decode([t]) == "1" else "p" for t in own] == list(mine)
            assert seen == (kuhn.view(history[1], card) if first == 0 and len(history) == 3 else "")
            assert sample.loss_mask[-1] == 1  # a sample ends with its agent's own move
            assert len(sample.rollout_log_probs) == sample.response_length
            assert all(lp < 0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m)
            assert sample.reward == env.rewards(state)[agent]
            assert sample.rollout_routed_experts.shape[0] == len(sample.tokens) - 1


def kuhn_args(tmp_path, *flags):
    return [
        "--config", str(EXAMPLES / "kuhn_poker_alternating.yaml"), "--output-dir", str(tmp_path), "--episodes-per-step", "16",
        "--action-warmup-steps", "0", "--no-progress", *flags,
    ]  # fmt: skip


def test_alternating_trains_only_the_active_agent(tmp_path):
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    train(load_config(kuhn_args(tmp_path, "--num-rollout", "2", "--co-evolution-interval", "2")))
    base, _ = registry.load("tiny")
    saved = {n: registry.model_for(str(tmp_path / "agents" / n)).state_dict() for n in kuhn.PLAYERS}
    assert all(torch.equal(saved["player_2"][k], v) for k, v in base.state_dict().items())
    assert any(not torch.equal(saved["player_1"][k], v) for k, v in base.state_dict().items())
    steps = read_metrics(tmp_path)
    assert [s["agent_trained_player_1"] for s in steps] == [1.0, 1.0]
    assert [s["agent_trained_player_2"] for s in steps] == [0.0, 0.0]
    assert all(s["exploitability_avg"] >= 0 for s in steps)


def test_population_opponents_are_stored_snapshots(tmp_path):
    """A drawn snapshot is in the opponent's engine exactly while the learner plays it; the
    opponent's current weights are back after; every stored snapshot gets drawn."""
    from miles.config import load_config
    from miles.multiagent.co_evolution import against_snapshots, make_agent

    cfg = load_config(kuhn_args(tmp_path, "--population-size", "3"))
    policy, tokenizer = registry.load("tiny")
    agents = {
        n: make_agent(n, i, copy.deepcopy(policy), tokenizer, cfg, 16, 8, resuming=False)
        for i, n in enumerate(kuhn.PLAYERS)
    }
    opponent = agents["player_2"]
    head = opponent.policy().lm_head.weight
    for i in range(4):  # four snapshots into a population of 3: the first is gone
        with torch.no_grad():
            head.fill_(float(i))
        opponent.snapshot(step=10 * i)
    assert [(step, float(w["model.embed_tokens.weight"][0, 0])) for step, w in opponent.snapshots] == [
        (10, 1.0),
        (20, 2.0),
        (30, 3.0),
    ]
    with torch.no_grad():
        head.fill_(7.0)  # the current weights, not yet in the engine
    opponent.push(5)
    rng, seen = random.Random(0), set()
    for _ in range(30):
        with against_snapshots(agents, "player_1", rng) as picks:
            engine = opponent.rollout
            stored = opponent.snapshots[picks["player_2"]][1]
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in stored.items())
            assert agents["player_1"].rollout.model.lm_head.weight.abs().max() < 7.0  # the learner: untouched
        seen.add(picks["player_2"])
        assert float(opponent.rollout.model.lm_head.weight[0, 0].detach()) == 7.0  # current weights back
    assert seen == {0, 1, 2}


def test_role_advantages_use_the_group_mean_inside_a_group():
    from miles.data.sample import Sample
    from miles.multiagent.episodes import role_advantages

    samples = [
        Sample(tokens=[1, 2, 3], response_length=2, reward=r, metadata=m)
        for r, m in [(1.0, {"group": 0}), (0.0, {"group": 0}), (0.5, {}), (0.25, {"group": 1})]
    ]
    got = [a.tolist() for a in role_advantages(samples, baseline=0.1)]
    # group 0: mean 0.5; no group and a group of one: the role's baseline
    assert got == [pytest.approx([v, v]) for v in (0.5, -0.5, 0.4, 0.15)]


def test_doctor_names_oscillation_and_dominance_and_its_remedies_load(tmp_path):
    """Swinging exploitability with an unconverged average (the simultaneous run's shape), or one
    agent winning every episode, is named; the remedies are valid flags on the run's own config."""
    import json

    import yaml

    from miles.config import load_config, to_dict
    from miles.doctor.checks import CHECKS
    from miles.doctor.run import load_run

    cfg = load_config(["--config", str(EXAMPLES / "kuhn_poker_simultaneous.yaml")])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))

    def write(rows):
        lines = [json.dumps({"rollout": i, "reward_mean": 0.0, **row}) for i, row in enumerate(rows)]
        (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return CHECKS["co_evolution_instability"].run(load_run(tmp_path), None)

    swing = [{"exploitability": 0.5 + 0.8 * (i // 10 % 2), "exploitability_avg": 0.7} for i in range(60)]
    found = write(swing)
    assert found and "neither settles" in found.cause
    flags = [r.flags for r in found.remedies]
    assert ["--strategy", "alternating"] in flags and ["--population-size", "4"] in flags
    for f in flags:
        load_config(["--config", str(tmp_path / "config.yaml"), *f])
    settled = [{"exploitability": 0.5 + 0.8 * (i // 10 % 2), "exploitability_avg": 0.1} for i in range(60)]
    assert write(settled) is None  # the average policy converged: fictitious play's promise
    stuck = [
        {"exploitability": 0.6667, "exploitability_avg": 0.667, "bet_player_1_J_": 1.0} for _ in range(60)
    ]
    found = write(stuck)  # always bet / always call: a corner no gradient leaves
    assert (
        found and "stopped exploring" in found.cause and "100% of P(bet) at 0 or 1" in found.evidence[0].note
    )
    assert ["--magnet-kl-coef", "0.5"] in [r.flags for r in found.remedies]
    # one corner, a jump to another, stuck there: too small a swing to oscillate, frozen at the end
    jumped = [{"exploitability": 0.6667 if i < 45 else 0.8333, "exploitability_avg": 0.57} for i in range(60)]
    found = write(jumped)
    assert found and "stopped exploring" in found.cause and "last fifth" in found.evidence[0].note
    dominated = [{"agent_reward_player_1": 0.9, "agent_reward_player_2": -0.9} for _ in range(40)]
    found = write(dominated)
    assert found and "player_1 dominates" in found.cause and "player_2 is dominated" in found.cause


def test_proposer_problems_and_rewards():
    from miles.multiagent.proposer_solver import parse_problem, proposer_reward

    assert parse_problem("8 - 6 = 0 8 = 00") == ("8 - 6", 2)
    assert parse_problem("x 12+7 =") == ("12 + 7", 19)
    assert parse_problem("1234 + 5", max_digits=3) is None
    assert parse_problem("11") is None
    assert [proposer_reward(True, p) for p in (0.0, 0.25, 0.75, 1.0)] == [0.0, 0.75, 0.25, 0.0]
    assert proposer_reward(False, 0.0) == -1.0
    assert proposer_reward(True, 0.25, repeat_share=0.5) == 0.25  # a problem half the batch also proposed
    assert proposer_reward(True, 1.0, repeat_share=0.25) == -0.25  # repeating pays less even when solved


def test_proposer_solver_episodes_score_each_attempt_and_group_them():
    """Every solver sample is one attempt at a proposed problem, graded by reasoning-gym against
    the problem's true value; the proposer's reward follows from its problem's attempts, less the
    share of the other proposals that are the same problem."""
    from miles.multiagent.proposer_solver import ProposerSolver

    policy, tokenizer = registry.load("tiny")
    env = ProposerSolver(seed=0, attempts=3, eval_size=8)
    engines = {n: Engine(copy.deepcopy(policy), tokenizer, 32, seed=i) for i, n in enumerate(env.agents)}
    states, samples = env.play(engines, tokenizer, 24, SamplingParams(temperature=1.0), seed=0)
    proposals = samples["proposer"]
    assert len(proposals) == 24 and sum(s["problem"] is not None for s in states) >= 3
    by_group: dict[int, list] = {}
    for s in samples["solver"]:
        assert s.loss_mask == [1] * s.response_length and s.metadata["agent"] == "solver"
        problem = states[s.metadata["group"]]["problem"]
        prompt = tokenizer.decode(s.tokens[: s.prompt_length])
        assert f"Calculate {problem[0]}." in prompt
        answer = tokenizer.decode(s.response_tokens, skip_special_tokens=True).strip()
        truth = str(eval(problem[0]))  # the oracle: Python's arithmetic
        assert s.reward == (
            1.0 if answer == truth else (len(truth) / len(answer) if truth in answer else 0.0)
        )
        by_group.setdefault(s.metadata["group"], []).append(s.reward)
    assert {len(v) for v in by_group.values()} == {3}
    assert_proposer_rewards(tokenizer, states, proposals, by_group)

    # greedy, one reference: every proposal is the same problem, paid 5/6 less than a lone one
    env.references = deque(["47 + 21"])
    states, samples = env.play(engines, tokenizer, 6, SamplingParams(temperature=0.0), seed=0)
    assert len({s["problem"] for s in states}) == 1 and states[0]["problem"] is not None
    groups = {i: [r.reward for r in samples["solver"] if r.metadata["group"] == i] for i in range(6)}
    assert_proposer_rewards(tokenizer, states, samples["proposer"], groups)


def assert_proposer_rewards(tokenizer, states, proposals, by_group) -> None:
    """Each proposal's reward from its problem's graded attempts (learnable: 1 - pass rate inside
    (0, 1)), less the share of the other proposals that wrote the same problem; -1 for none."""
    from miles.multiagent.proposer_solver import parse_problem

    problems = [
        parse_problem(tokenizer.decode(p.response_tokens, skip_special_tokens=True)) for p in proposals
    ]
    for i, (sample, state) in enumerate(zip(proposals, states)):
        assert state["problem"] == problems[i]
        passed = sum(r == 1.0 for r in by_group.get(i, [])) / 3
        learnable = 1 - passed if 0 < passed < 1 else 0.0
        repeats = problems.count(problems[i]) - 1
        want = -1.0 if problems[i] is None else learnable - repeats / len(proposals)
        assert sample.reward == pytest.approx(want)


@pytest.mark.parametrize(
    "flags",
    [
        (
            "--strategy",
            "simultaneous",
            "--co-evolution-interval",
            "1",
            "--population-size",
            "2",
        ),  # moving reference
        (
            "--strategy",
            "simultaneous",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.2",
            "--action-warmup-steps",
            "3",
        ),
    ],
    ids=["population-moving-reference", "fixed-reference-after-warm-up"],
)
def test_a_stopped_run_resumes_to_the_same_steps_and_weights(tmp_path, flags):
    """Two steps, stop, resume to four: the same metrics (rewards, snapshots drawn, the average
    policy's exploitability) and bitwise the same weights as four steps in one go, with each
    agent's KL reference (moved every interval, or fixed at the policy after the warm-up, which
    the resumed run does not repeat) restored."""
    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    whole, ckpt = tmp_path / "whole", tmp_path / "ckpt"
    train(load_config(kuhn_args(whole, *flags, "--num-rollout", "4")))
    part = tmp_path / "part"
    train(load_config(kuhn_args(part, *flags, "--num-rollout", "2", "--save", str(ckpt))))
    train(
        load_config(kuhn_args(part, *flags, "--num-rollout", "4", "--save", str(ckpt), "--load", str(ckpt)))
    )
    a, b = read_metrics(whole), read_metrics(part)
    assert [s["rollout"] for s in b] == [0, 1, 2, 3]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if "time" not in k} == {
            k: v for k, v in y.items() if "time" not in k
        }
    for name in kuhn.PLAYERS:
        ours = registry.model_for(str(whole / "agents" / name)).state_dict()
        theirs = registry.model_for(str(part / "agents" / name)).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_agent_overrides_set_one_agents_trainer_and_bad_ones_are_named(tmp_path):
    from miles.config import load_config
    from miles.errors import ConfigError
    from miles.multiagent.co_evolution import agent_config, moving_reference

    over = '{"player_2": {"use_kl_loss": true, "kl_loss_coef": 0.5, "lr": 1e-5}}'
    cfg = load_config(kuhn_args(tmp_path, "--agent-overrides", over))
    one, two = agent_config(cfg, 0, 8, "player_1"), agent_config(cfg, 1, 8, "player_2")
    assert (one.algo.use_kl_loss, one.algo.kl_loss_coef, one.train.lr) == (
        True,
        0.5,
        cfg.train.lr,
    )  # the magnet
    assert (two.algo.use_kl_loss, two.algo.kl_loss_coef, two.train.lr) == (True, 0.5, 1e-5)
    assert (moving_reference(cfg, "player_1"), moving_reference(cfg, "player_2")) == (
        True,
        False,
    )  # its own pull
    off = load_config(kuhn_args(tmp_path, "--agent-overrides", over, "--magnet-kl-coef", "0"))
    assert agent_config(off, 0, 8, "player_1").algo.use_kl_loss is False
    with pytest.raises(ConfigError, match="unknown setting 'kl_coeff'"):
        load_config(kuhn_args(tmp_path, "--agent-overrides", '{"player_2": {"kl_coeff": 1}}'))
    with pytest.raises(ConfigError, match="shared by every agent"):
        load_config(kuhn_args(tmp_path, "--agent-overrides", '{"player_2": {"num_rollout": 3}}'))
    with pytest.raises(ConfigError, match=r"the agents of kuhn_poker are \['player_1', 'player_2'\]"):
        from miles.run import train

        train(load_config(kuhn_args(tmp_path, "--agent-overrides", '{"dealer": {"lr": 1e-5}}')))


def test_the_magnet_moves_the_kl_reference_to_the_policy_or_to_saved_weights():
    """--magnet-kl-coef's reference: after a step the policy has left it (KL > 0); moved, it is
    the policy (KL exactly 0); moved to saved weights, it is those (the KL before the move)."""
    from miles.config import load_config
    from miles.data.sample import Sample
    from miles.train.policy_trainer import PolicyTrainer

    cfg = load_config(["--model", "tiny", "--use-kl-loss", "--kl-loss-coef", "0.5", "--lr", "1e-2"])
    trainer = PolicyTrainer(registry.model_for("tiny"), cfg)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(tokens=torch.randint(0, 250, (12,), generator=g).tolist(), response_length=6) for _ in range(4)
    ]
    start = {k: v.clone() for k, v in trainer.hf_weights().items()}
    trainer.train(samples, [torch.tensor([1.0, -1.0] * 3) for _ in samples])
    moved_away = torch.cat(trainer.reference_kl(samples)).abs().max()
    assert moved_away > 1e-4
    trainer.reset_reference()
    assert torch.cat(trainer.reference_kl(samples)).abs().max() == 0
    trainer.reset_reference(start)
    assert torch.cat(trainer.reference_kl(samples)).abs().max() == moved_away
    magnet = {name: load_config(["--config", str(EXAMPLES / name)]).co_evolution.magnet_kl_coef
              for name in ("kuhn_poker.yaml", "kuhn_poker_alternating.yaml", "kuhn_poker_simultaneous.yaml")}  # fmt: skip
    assert magnet == {
        "kuhn_poker.yaml": 0.5,
        "kuhn_poker_alternating.yaml": 0.5,
        "kuhn_poker_simultaneous.yaml": 0,
    }
    pulled = load_config(["--config", str(EXAMPLES / "kuhn_poker_alternating.yaml"), "--use-kl-loss"])
    assert pulled.co_evolution.magnet_kl_coef == 0  # a fixed pull asked for: no moving one


def test_the_payoff_table_averages_each_snapshot_age_over_the_second_half(tmp_path):
    import json

    from miles.diagnostics.plot import payoff_table, plot_run

    rows = [
        {"rollout": -1, "win_rate_player_1_vs_player_2_age0": 0.0},  # before training: not a step
        {"rollout": 0, "win_rate_player_1_vs_player_2_age0": 0.9},  # first half: left out
        {"rollout": 1, "win_rate_player_1_vs_player_2_age1": 0.9},
        {"rollout": 2, "win_rate_player_1_vs_player_2_age0": 0.2, "win_rate_player_2_vs_player_1_age1": 0.5},
        {"rollout": 3, "win_rate_player_1_vs_player_2_age0": 0.6, "win_rate_player_1_vs_player_2_age1": 0.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = payoff_table(rows)
    assert table == {
        "player_1 vs player_2": {0: pytest.approx(0.4), 1: 0.3},
        "player_2 vs player_1": {1: 0.5},
    }
    written = plot_run(tmp_path)
    assert tmp_path / "plots" / "population_payoff.png" in written


def test_a_driver_killed_mid_step_resumes_to_the_uninterrupted_run(tmp_path):
    """--fault-inject driver@step:1 on a population run (snapshots drawn, a moving KL
    reference): the driver is SIGKILLed while training step 1; resumed from the checkpoint of
    step 0, the run logs the same metrics and ends with bitwise the same weights as one never
    stopped, and the fault fires once."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from miles.config import load_config
    from miles.diagnostics.metrics_file import read_metrics
    from miles.run import train

    flags = ("--strategy", "simultaneous", "--co-evolution-interval", "1", "--population-size", "2",
             "--num-rollout", "3")  # fmt: skip
    train(load_config(kuhn_args(tmp_path / "whole", *flags)))
    ckpt, part = tmp_path / "ckpt", tmp_path / "part"
    args = kuhn_args(
        part, *flags, "--save", str(ckpt), "--save-interval", "1", "--fault-inject", "driver@step:1"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "miles.cli", "train", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert int((ckpt / "latest").read_text()) == 0
    train(load_config([*args, "--load", str(ckpt)]))
    a, b = read_metrics(tmp_path / "whole"), read_metrics(part)
    assert [s["rollout"] for s in b] == [s["rollout"] for s in a] == [0, 1, 2]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if "time" not in k} == {
            k: v for k, v in y.items() if "time" not in k
        }
    for name in kuhn.PLAYERS:
        ours = registry.model_for(str(tmp_path / "whole" / "agents" / name)).state_dict()
        theirs = registry.model_for(str(part / "agents" / name)).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    fired = [json.loads(line)["fault"] for line in (part / "faults_fired.jsonl").read_text().splitlines()]
    assert fired == ["driver@step:1"]


def test_the_guides_remedy_on_the_symptom_config_turns_the_moving_reference_on(tmp_path, caplog):
    """The symptom config (simultaneous, no pull by default) plus the guide's three flags as a user
    adds them is the remedy with the moving KL reference (the same settings as
    kuhn_poker_alternating.yaml); an explicit --magnet-kl-coef 0 with those remedies is warned at
    start and named by `miles doctor`, whose remedy turns it back on."""
    import yaml

    from miles.config import load_config, to_dict
    from miles.doctor.checks import CHECKS
    from miles.doctor.run import load_run

    symptom = ["--config", str(EXAMPLES / "kuhn_poker_simultaneous.yaml")]
    guide = ["--strategy", "alternating", "--population-size", "4", "--co-evolution-interval", "20"]
    assert load_config(symptom).co_evolution.magnet_kl_coef == 0
    remedied = load_config([*symptom, *guide])
    alternating = load_config(["--config", str(EXAMPLES / "kuhn_poker_alternating.yaml")])
    assert remedied.co_evolution.magnet_kl_coef == 0.5
    same = {k: v for k, v in to_dict(remedied).items() if k != "logging"}
    assert same == {k: v for k, v in to_dict(alternating).items() if k != "logging"}
    with caplog.at_level("WARNING", logger="miles"):
        off = load_config([*symptom, *guide, "--magnet-kl-coef", "0"])
    assert "--magnet-kl-coef 0 with --strategy alternating" in caplog.text
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(off)))
    (tmp_path / "metrics.jsonl").write_text(
        '{"rollout": 0, "reward_mean": 0.0, "exploitability_avg": 0.667}\n'
    )
    found = CHECKS["co_evolution_no_pull"].run(load_run(tmp_path), None)
    assert found and [r.flags for r in found.remedies] == [["--magnet-kl-coef", "0.5"]]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(remedied)))
    assert CHECKS["co_evolution_no_pull"].run(load_run(tmp_path), None) is None
