"""Online training of a speculative-decoding draft on the policy's own rollouts.

As RL moves the policy, a frozen draft predicts it worse and worse (acceptance drifts down).
Every --online-sft-interval steps the draft takes a few AdamW steps of next-token cross-entropy on
the latest rollouts' response tokens (the policy's samples) at --draft-lr. --draft-ema-decay keeps
an exponential moving average of the draft's weights, and the engine serves the average;
--reinit-draft-interval starts the draft over from the current policy every N steps. None of this
touches the policy or its gradients.

`replay_windows`: each training also passes again over the samples of that many earlier trainings,
so a token is learned from several times while the policy has barely moved (an EAGLE head, which
starts from nothing, needs several passes over its data; see EagleTrainer).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from miles.data.sample import Sample
from miles.models.eagle import draft_logits
from miles.models.transformer import Transformer
from miles.rollout.speculative import sampling_probs


class DraftTrainer:
    def __init__(
        self,
        draft: Transformer,
        lr: float = 1e-3,
        ema_decay: float | None = None,
        reinit: Callable[[], Transformer] | None = None,
        micro_batch: int = 64,
        replay_windows: int = 0,
    ) -> None:
        self.model = copy.deepcopy(draft).train()
        self.lr, self.ema_decay, self.reinit_from, self.micro_batch = lr, ema_decay, reinit, micro_batch
        self.replay_windows = replay_windows
        self.replay: list[list[Sample]] = []  # the samples of the last `replay_windows` trainings
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
        """One pass over the replayed windows and then `samples`; returns draft_sft_loss (over `samples`)."""
        older = [s for window in self.replay for s in window]
        if self.replay_windows:
            self.replay = [*self.replay, list(samples)][-self.replay_windows :]
        if older:
            self.fit(older)
        metrics = self.fit(samples)
        if self.ema is not None:
            with torch.no_grad():
                for e, p in zip(self.ema.parameters(), self.model.parameters()):
                    e.lerp_(p.detach(), 1 - self.ema_decay)
                for e, b in zip(self.ema.buffers(), self.model.buffers()):
                    e.copy_(b)
        return metrics

    def fit(self, samples: Sequence[Sample]) -> dict[str, float]:
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
        return {"draft_sft_loss": total / max(count, 1)}


class EagleTrainer(DraftTrainer):
    """Online training of an EAGLE head (`miles.models.eagle`) on the policy's own rollouts.

    For response token i sampled from the policy's feature F[i], the head takes (F[i], token i)
    and predicts F[i + 1]: the loss is the cross-entropy of the head's distribution against the
    policy's own one at F[i + 1] (both over the head's vocabulary: acceptance is their overlap).
    A second, chained step feeds the prediction back, as decoding does for the draft's later
    tokens. The head starts from nothing and learns from the number of steps: small micro-batches
    (2 sequences), and each training passes again over the samples of the two before it (each
    token is learned from three times; more passes over the same tokens gain little). The
    features are those the engine computed while sampling (`Sample.draft_features`); a sample
    without them (an agent's, a partial one) gets them from a forward pass of `policy()`. The
    policy's embedding and lm_head are read, never trained.
    """

    def __init__(
        self,
        draft,
        policy: Callable[[], Transformer],
        lr: float = 1e-3,
        micro_batch: int = 2,
        replay_windows: int = 2,
        **kw,
    ) -> None:
        super().__init__(draft, lr, micro_batch=micro_batch, replay_windows=replay_windows, **kw)
        self.policy = policy

    @torch.no_grad()
    def features(self, policy: Transformer, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Each sample's (response length, hidden) features, from the sample or from `policy`."""
        device = policy.lm_head.weight.device
        out = []
        for s in samples:
            if s.draft_features is not None and len(s.draft_features) == s.response_length:
                out.append(torch.from_numpy(s.draft_features).to(device, torch.float32))
                continue
            ids = torch.tensor([s.tokens], device=device)
            hidden = policy(ids).hidden[0].float()
            out.append(hidden[s.prompt_length - 1 : len(s.tokens) - 1])
        return out

    def train(self, samples: Sequence[Sample]) -> dict[str, float]:
        """Count the new samples' tokens, choose the head's vocabulary, then train as DraftTrainer."""
        for s in samples:
            self.model.count(torch.tensor(s.response_tokens))
        self.model.choose_vocab()
        return super().train(samples)

    def fit(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One pass over `samples`; returns draft_sft_loss (the cross-entropy part, per prediction)."""
        head, policy = self.model, self.policy()
        embed, lm_head = policy.model.embed_tokens.weight.detach(), policy.lm_head.weight.detach()
        samples = [s for s in samples if s.response_length >= 2]
        rows = lm_head[head.vocab.to(lm_head.device)]
        total, count = 0.0, 0
        for start in range(0, len(samples), self.micro_batch):
            chunk = samples[start : start + self.micro_batch]
            loss, ce_sum, ce_count = self._chunk_loss(head, policy, chunk, embed, rows)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total, count = total + ce_sum, count + ce_count
        return {"draft_sft_loss": total / max(count, 1)}

    @torch.no_grad()
    def acceptance(
        self,
        samples: Sequence[Sample],
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        positions: int = 3,
    ) -> list[float]:
        """The served head's expected acceptance at draft positions 1..`positions` on `samples`.

        At each, the mean over response positions of sum_x min(p(x), q(x)), p the policy's and q
        the head's sampling distribution (temperature, top-k, top-p; exact speculative sampling
        accepts with exactly that probability). Position j > 1 feeds the head its own predicted
        feature and the recorded tokens, as decoding chains them, so it is the acceptance given
        the positions before it were accepted."""
        head, policy = self.served(), self.policy()
        embed, lm_head = policy.model.embed_tokens.weight.detach(), policy.lm_head.weight.detach()
        vocab = head.vocab.to(lm_head.device)
        rows = lm_head[vocab]

        def sampled(logits: torch.Tensor) -> torch.Tensor:  # (n, V) logits -> the distribution drawn from
            n = len(logits)
            params = (
                torch.full((n,), float(temperature)),
                torch.full((n,), top_k),
                torch.full((n,), float(top_p)),
            )
            return sampling_probs(logits[:, None], *params)[:, 0]

        total, count = [0.0] * positions, [0] * positions
        for s, f in zip(samples, self.features(policy, samples)):
            tokens, feature = torch.tensor(s.response_tokens, device=embed.device), f[:-1]
            for j in range(min(positions, len(f) - 1)):
                n = len(f) - 1 - j  # (feature i + j, token i + j) -> the policy's feature i + j + 1
                feature = head(embed[tokens[j : j + n]], feature[:n])
                q = torch.zeros(n, lm_head.shape[0], device=embed.device)
                q[:, vocab] = sampled(draft_logits(feature, rows))
                p = sampled(F.linear(f[j + 1 :], lm_head).float())
                total[j] += float(torch.minimum(p, q).sum())
                count[j] += n
        return [t / max(c, 1) for t, c in zip(total, count)]

    def _chunk_loss(self, head, policy, chunk, embed, rows, chained: int = 2):
        """The loss of `chained` linked predictions from every response position of `chunk`."""
        feats = self.features(policy, chunk)
        lengths = torch.tensor([s.response_length for s in chunk], device=embed.device)
        R, H = int(lengths.max()), embed.shape[1]
        F_all = embed.new_zeros(len(chunk), R + chained, H)  # F[b, i]: what token i was sampled from
        tokens = torch.zeros(len(chunk), R + chained, dtype=torch.long, device=embed.device)
        for b, (s, f) in enumerate(zip(chunk, feats)):
            F_all[b, : len(f)] = f
            tokens[b, : len(f)] = torch.tensor(s.response_tokens)
        at = torch.arange(R - 1, device=embed.device)
        feature, loss, ce_sum, ce_count = F_all[:, : R - 1], 0.0, 0.0, 0
        for step in range(chained):  # step 0: (F[i], token i) -> F[i + 1]; step 1 feeds the prediction back
            valid = at[None] + step + 1 < lengths[:, None]
            if not bool(valid.any()):
                break
            predicted = head(embed[tokens[:, step : step + R - 1]], feature)
            target = F_all[:, step + 1 : step + R][valid]
            wanted = draft_logits(target, rows).softmax(-1)  # the policy's own distribution there
            ce = -(wanted * draft_logits(predicted[valid], rows).log_softmax(-1)).sum(-1)
            loss = loss + ce.mean()
            ce_sum, ce_count = ce_sum + float(ce.detach().sum()), ce_count + len(ce)
            feature = predicted
        return loss, ce_sum, ce_count
