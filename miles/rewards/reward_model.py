"""A reward model: the policy's network with a scalar head, scoring a whole sequence.

Hugging Face's `*ForSequenceClassification` layout with one label: the transformer, then
`score` (hidden -> 1, no bias) in place of the LM head; a sequence's reward is the head at its
last token (prompt + response, the response ending with EOS as it was trained). `miles rm`
trains one (Bradley-Terry, `miles.train.reward_training`) and saves it here; `--rm-type model
--rm-path DIR` scores rollouts with it, in batches, in the run's own process.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn

from miles.data.sample import Sample
from miles.errors import ConfigError
from miles.models.checkpoint import (
    hf_state_dict,
    load_state_dict_into,
    read_config,
    read_tensors,
    save_model,
    tensor_files,
)
from miles.models.transformer import Transformer

HEAD = "score.weight"


def with_score_head(model: Transformer) -> Transformer:
    """`model` with a zero scalar head in place of its LM head (untied)."""
    model.config.tie_word_embeddings = False
    head = nn.Linear(model.config.hidden_size, 1, bias=False)
    nn.init.zeros_(head.weight)
    model.lm_head = head.to(next(model.parameters()).device)
    return model


def sequence_rewards(model: Transformer, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B,) the head at each sequence's last token (right-padded batch, one forward)."""
    lengths = torch.tensor([len(s) for s in sequences])
    ids = torch.zeros(len(sequences), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(list(s))
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    device = model.lm_head.weight.device
    out = model(ids.to(device), attention_mask=mask.to(device)).logits[..., 0]
    return out[torch.arange(len(sequences), device=device), (lengths - 1).to(device)]


def save_reward_model(model: Transformer, path: str | Path, tokenizer=None) -> Path:
    """An HF checkpoint of the reward model (`*ForSequenceClassification`, num_labels 1)."""
    state = hf_state_dict(model)
    state[HEAD] = state.pop("lm_head.weight")
    path = save_model(model, path, tokenizer=tokenizer, state=state)
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    arch = config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    config.update(architectures=[arch], num_labels=1, tie_word_embeddings=False)
    config_file.write_text(json.dumps(config, indent=2))
    return Path(path)


def is_reward_model(path: str | Path) -> bool:
    """Whether `path` holds a reward model (one label, *ForSequenceClassification)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    return config.get("num_labels") == 1 and config.get("architectures", [""])[0].endswith(
        "ForSequenceClassification"
    )


def load_reward_model(path: str | Path, flag: str = "--rm-path") -> Transformer:
    """The reward model `save_reward_model` wrote (checked tensor by tensor)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"{flag} {path}: no config.json; give the directory `miles rm --save` wrote")
    config = json.loads((path / "config.json").read_text())
    if config.get("num_labels") != 1 or not config.get("architectures", [""])[0].endswith(
        "ForSequenceClassification"
    ):
        raise ConfigError(
            f"{flag} {path}: not a reward model (one label, *ForSequenceClassification); train one with miles rm"
        )
    model = with_score_head(Transformer(read_config(path)))
    files = tensor_files(path)
    state = read_tensors(path, files, files.keys())
    state["lm_head.weight"] = state.pop(HEAD)
    load_state_dict_into(model, state, str(path))
    return model.eval().requires_grad_(False)


class ModelReward:
    """--rm-type model: each sample's reward is the reward model's score of its tokens."""

    def __init__(self, path: str, batch_size: int = 32) -> None:
        self.model, self.batch_size = load_reward_model(path), batch_size

    @torch.no_grad()
    def score(self, samples: Sequence[Sample]) -> list[float]:
        out: list[float] = []
        for i in range(0, len(samples), self.batch_size):
            chunk = samples[i : i + self.batch_size]
            out += sequence_rewards(self.model, [s.tokens for s in chunk]).float().tolist()
        return out
