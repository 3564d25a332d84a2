"""Online training of a speculative-decoding draft on the policy's own rollouts.

As RL moves the policy, a frozen draft predicts it worse and worse (acceptance drifts down).
Every --online-sft-interval steps the draft takes a few AdamW steps of next-token cross-entropy on
the latest rollouts' response tokens (the policy's samples) at --draft-lr. --draft-ema-decay keeps
an exponential moving average of the draft's weights, and the engine serves the average;
--reinit-draft-interval starts the draft over from the current policy every N steps. None of this
touches the policy or its gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from miles.data.sample import Sample
from miles.models.transformer import Transformer


class DraftTrainer:
    def __init__(
        self,
        draft: Transformer,
        lr: float = 1e-3,
        ema_decay: float | None = None,
        reinit: Callable[[], Transformer] | None = None,
        micro_batch: int = 64,
    ) -> None:
        self.model = copy.deepcopy(draft).train()
        self.lr, self.ema_decay, self.reinit_from, self.micro_batch = lr, ema_decay, reinit, micro_batch
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.ema = copy.deepcopy(self.model).eval() if ema_decay is not None else None

    def served(self) -> Transformer:
        """The weights the engine should use: the EMA when there is one."""
        return self.ema if self.ema is not None else self.model

    def reinit(self) -> None:
        """Start over from the policy as it is now (--reinit-draft-interval)."""
        fresh = self.reinit_from()
        self.model.load_state_dict(fresh.state_dict())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        if self.ema is not None:
            self.ema.load_state_dict(fresh.state_dict())

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One pass over `samples` (responses only are predicted); returns draft_sft_loss."""
        device = self.model.lm_head.weight.device
        total, count = 0.0, 0
        for start in range(0, len(samples), self.micro_batch):
            chunk = [s for s in samples[start : start + self.micro_batch] if s.response_length > 0]
            if not chunk:
                continue
            T = max(len(s.tokens) for s in chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T, dtype=torch.bool)
            target = torch.zeros(
                len(chunk), T, dtype=torch.bool
            )  # positions whose next token is a response token
            for b, s in enumerate(chunk):
                ids[b, : len(s.tokens)] = torch.tensor(s.tokens)
                mask[b, : len(s.tokens)] = True
                prompt = len(s.tokens) - s.response_length
                target[b, prompt - 1 : len(s.tokens) - 1] = True
            ids, mask, target = ids.to(device), mask.to(device), target.to(device)
            logits = self.model(ids, attention_mask=mask).logits[:, :-1]
            labels = ids[:, 1:]
            chosen = target[:, :-1]
            loss = F.cross_entropy(logits[chosen], labels[chosen])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += loss.item() * int(chosen.sum())
            count += int(chosen.sum())
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), self.model.parameters()):
                    e.lerp_(p.detach(), 1 - self.ema_decay)
        return {"draft_sft_loss": total / max(count, 1)}
