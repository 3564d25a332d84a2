"""Kuhn Poker: two players, exact exploitability of any pair of policies.

Three cards J < Q < K, one to each player, both ante 1. Player 1 passes ("p") or bets 1 ("b");
after a pass player 2 passes (showdown for 1) or bets, and player 1 then folds ("p", player 2
wins 1) or calls ("b", showdown for 2); after a bet player 2 folds (player 1 wins 1) or calls
(showdown for 2). A player sees its card and the public history: 12 information sets,
written "K|" (player 1's first move with a K), "K|pb" (player 1 facing a bet after its pass),
"Q|p" and "Q|b" (player 2). A policy is P(bet) at each. As text, moves are 0 (pass) and 1 (bet)
and cards 7, 8, 9 (J, Q, K): a player's text at "K|pb" is "9", its own "0", then "19" (the new
move and its card again), and its response is its move.

Exploitability (NashConv) = what each player's best response to the other gains over the
policies' own value, summed: 0 exactly at a Nash equilibrium, 11/12 for the uniform policy. The
game value for player 1 at equilibrium is -1/18.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from miles.multiagent.actions import read_policy

CARDS = "JQK"
RANK = {c: i for i, c in enumerate(CARDS)}
PLAYERS = ("player_1", "player_2")
HISTORIES = {"player_1": ("", "pb"), "player_2": ("p", "b")}
INFOSETS = {p: [f"{c}|{h}" for c in CARDS for h in HISTORIES[p]] for p in PLAYERS}
TERMINAL = {"pp", "bp", "bb", "pbp", "pbb"}
DEALS = ["".join(d) for d in itertools.permutations(CARDS, 2)]  # (player 1's card, player 2's)

Policy = dict[str, float]  # information set -> P(bet)


def payoff(cards: str, history: str) -> float:
    """Player 1's winnings at a terminal history, cards = (player 1's, player 2's)."""
    if history == "bp":  # player 2 folded
        return 1.0
    if history == "pbp":  # player 1 folded
        return -1.0
    stake = 2.0 if history in ("bb", "pbb") else 1.0
    return stake if RANK[cards[0]] > RANK[cards[1]] else -stake


def to_act(history: str) -> int | None:
    """0 or 1 (the player to move), None at the end."""
    return None if history in TERMINAL else len(history) % 2


def infoset(cards: str, history: str) -> str:
    player = len(history) % 2
    return f"{cards[player]}|{history}"


# as text, digits: a model trained on arithmetic reads and writes them (letters it never saw
# have untrained embeddings, and its output hardly depends on them)
MOVE_TEXT = {"p": "0", "b": "1"}
CARD_TEXT = {"J": "7", "Q": "8", "K": "9"}


def view(new_moves: str, card: str) -> str:
    """One turn's observation: the opponent's moves since the player's own last one, then its
    card (the last token before the move, where a small model reads it best)."""
    return "".join(MOVE_TEXT[m] for m in new_moves) + CARD_TEXT[card]


def transcript(key: str) -> str:
    """The text a player has seen (its own moves included) at information set `key`, built by the
    environment's own `observe` and `act` replaying the history: "K|pb" -> "9" (its K) + "0" (its
    pass) + "19" (the bet, its card again)."""
    card, history = key.split("|")
    agent = PLAYERS[len(history) % 2]
    env = KuhnPoker()
    state = {
        "cards": card + card,
        "history": "",
        "seen": {p: 0 for p in PLAYERS},
    }  # only its own card is read
    text = ""
    for move in history:
        mover = env.current(state)
        if mover == agent:
            text += env.observe(state, agent) + MOVE_TEXT[move]
        env.act(state, mover, MOVE_TEXT[move])
    return text + env.observe(state, agent)


def _value(cards: str, history: str, policies: tuple[Policy, Policy]) -> float:
    player = to_act(history)
    if player is None:
        return payoff(cards, history)
    bet = policies[player][infoset(cards, history)]
    return bet * _value(cards, history + "b", policies) + (1 - bet) * _value(cards, history + "p", policies)


def game_value(p1: Policy, p2: Policy) -> float:
    """Player 1's expected winnings (player 2's are the negative)."""
    return sum(_value(d, "", (p1, p2)) for d in DEALS) / len(DEALS)


def best_response_value(responder: int, policies: tuple[Policy, Policy]) -> float:
    """The responder's (0 or 1) expected winnings when it best-responds to the other's policy."""
    sign = 1.0 if responder == 0 else -1.0
    cache: dict[str, float] = {}

    def action_values(card: str, history: str) -> dict[str, float]:
        """For the responder's information set (card, history): the chance-and-opponent-weighted
        value of each action (responder's perspective), summed over the opponent's cards."""
        out = {}
        for action in "pb":
            total = 0.0
            for d in DEALS:
                if d[responder] == card:
                    total += opponent_reach(d, history) * reach_value(d, history + action) / len(DEALS)
            out[action] = total
        return out

    def opponent_reach(d: str, history: str) -> float:
        """The probability that the opponent's moves (holding its card of deal d) produce `history`."""
        p = 1.0
        for i, action in enumerate(history):
            if i % 2 != responder:
                bet = policies[i % 2][infoset(d, history[:i])]
                p *= bet if action == "b" else 1 - bet
        return p

    def reach_value(d: str, history: str) -> float:
        """Sum over continuations: opponent moves by its policy, responder by its best response."""
        player = to_act(history)
        if player is None:
            return sign * payoff(d, history)
        if player != responder:
            bet = policies[player][infoset(d, history)]
            return bet * reach_value(d, history + "b") + (1 - bet) * reach_value(d, history + "p")
        # the responder's choice depends on its information set only: the best action for it
        key = infoset(d, history)
        if key not in cache:
            card, h = key.split("|")
            values = action_values(card, h)
            cache[key] = max(values, key=values.get)
        return reach_value(d, history + cache[key])

    return sum(reach_value(d, "") for d in DEALS) / len(DEALS)


def exploitability(p1: Policy, p2: Policy) -> float:
    """NashConv: best-response gains of both players (0 at a Nash equilibrium)."""
    v = game_value(p1, p2)
    return (best_response_value(0, (p1, p2)) - v) + (best_response_value(1, (p1, p2)) + v)


def uniform() -> tuple[Policy, Policy]:
    return tuple({s: 0.5 for s in INFOSETS[p]} for p in PLAYERS)  # type: ignore[return-value]


def nash(alpha: float = 0.0) -> tuple[Policy, Policy]:
    """The equilibrium family (alpha in [0, 1/3]): player 1 bluffs J with alpha, bets K with
    3 alpha, calls with Q at alpha + 1/3; player 2 bluffs J after a pass with 1/3, calls with Q
    at 1/3."""
    p1 = {"J|": alpha, "J|pb": 0.0, "Q|": 0.0, "Q|pb": alpha + 1 / 3, "K|": 3 * alpha, "K|pb": 1.0}
    p2 = {"J|p": 1 / 3, "J|b": 0.0, "Q|p": 0.0, "Q|b": 1 / 3, "K|p": 1.0, "K|b": 1.0}
    return p1, p2


def own_reach(player: str, policy: Policy, key: str) -> float:
    """The probability that `player`'s own moves lead to information set `key`."""
    card, history = key.split("|")
    if player == "player_1" and history == "pb":
        return 1.0 - policy[f"{card}|"]
    return 1.0


@dataclass
class AveragePolicy:
    """The average of a player's policies over training steps, each information set weighted by
    the player's own probability of reaching it (the behaviour policy of the mixture)."""

    player: str
    bet: dict[str, float] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)

    def add(self, policy: Policy) -> None:
        for key in INFOSETS[self.player]:
            w = own_reach(self.player, policy, key)
            self.bet[key] = self.bet.get(key, 0.0) + w * policy[key]
            self.weight[key] = self.weight.get(key, 0.0) + w

    def policy(self) -> Policy:
        return {k: self.bet[k] / self.weight[k] if self.weight[k] > 0 else 0.5 for k in INFOSETS[self.player]}


class KuhnPoker:
    """The multi-agent environment (see `miles.multiagent.episodes.Environment`)."""

    agents = PLAYERS
    action_tokens = ("0", "1")  # pass, bet: a response starting with "1" bets, anything else passes
    max_seq_len = 16  # the longest transcript has 6 tokens

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def reset(self) -> dict:
        return {"cards": "".join(self.rng.sample(CARDS, 2)), "history": "", "seen": {p: 0 for p in PLAYERS}}

    def current(self, state: dict) -> str | None:
        player = to_act(state["history"])
        return None if player is None else PLAYERS[player]

    def observe(self, state: dict, agent: str) -> str:
        """What `agent` sees that it has not seen yet: its card and the history so far first,
        then the opponent's moves since its own last one."""
        player = PLAYERS.index(agent)
        history, seen = state["history"], state["seen"][agent]
        return view(history[seen:], state["cards"][player])

    def act(self, state: dict, agent: str, text: str) -> str:
        """Apply the agent's response; returns the action as it enters the history."""
        action = "b" if text[:1] == MOVE_TEXT["b"] else "p"
        state["history"] += action
        state["seen"][agent] = len(state["history"])
        return action

    def rewards(self, state: dict) -> dict[str, float]:
        v = payoff(state["cards"], state["history"])
        return {"player_1": v, "player_2": -v}

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])

    def warmup_prompts(self, agent: str) -> list[str]:
        return [transcript(k) for k in INFOSETS[agent]]

    def tracker(self) -> KuhnTracker:
        return KuhnTracker()


class KuhnTracker:
    """Per step: each policy read from its model, the exploitability of the current and of the
    average policies, the game value, and P(bet) at every information set."""

    def __init__(self) -> None:
        self.average = {p: AveragePolicy(p) for p in PLAYERS}

    def state_dict(self) -> dict:
        return {p: (a.bet, a.weight) for p, a in self.average.items()}

    def load_state_dict(self, state: dict) -> None:
        for p, (bet, weight) in state.items():
            self.average[p] = AveragePolicy(p, dict(bet), dict(weight))

    def __call__(self, env: KuhnPoker, models: dict, tokenizer, rollouts=None) -> dict[str, float]:
        current = {
            p: dict(zip(INFOSETS[p], read_policy(models[p], tokenizer, [transcript(k) for k in INFOSETS[p]],
                                                env.action_tokens)))
            for p in PLAYERS
        }  # fmt: skip
        for p in PLAYERS:
            self.average[p].add(current[p])
        avg = {p: self.average[p].policy() for p in PLAYERS}
        out = {
            "exploitability": exploitability(current["player_1"], current["player_2"]),
            "exploitability_avg": exploitability(avg["player_1"], avg["player_2"]),
            "game_value": game_value(current["player_1"], current["player_2"]),
        }
        for p in PLAYERS:
            out.update({f"bet_{p}_{key.replace('|', '_')}": v for key, v in current[p].items()})
        return out
