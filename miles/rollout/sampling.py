"""Next-token sampling: temperature, top-k, top-p, per-request seeds, and the logprob reported.

The reported log-probability of a sampled token is log softmax(logits / temperature)[token]:
the temperature-scaled distribution over the whole vocabulary, before top-k/top-p truncation
(with temperature 0, greedy, it is log softmax(logits)). The trainer computes the same quantity
with `miles.algo.token_logprobs(logits, tokens, temperature)`.

A token is drawn by inverting the CDF of its distribution at one uniform from the request's own
generator (`draw`), so a request's tokens depend on its seed alone, never on which other
requests share the batch; one number a row and step (Gumbel-max would draw one per vocabulary
entry: at a 49k vocabulary and 64 rows, most of a SmolLM2 step's sampling time).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from miles.algo.logprobs import tempered
from miles.data.sample import Sample
from miles.errors import MilesError


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = whole vocabulary
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    ignore_eos: bool = False
    seed: int | None = None  # None: derived from the engine seed and the request id

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise MilesError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise MilesError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise MilesError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.top_k, int):
            raise MilesError(f"top_k must be an integer, got {self.top_k!r}")


def allowed_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k and top-p set. logits: (B, V) scaled."""
    V = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None]
    keep_sorted = rank < k[:, None]
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    keep_sorted &= mass_before < top_p[:, None]  # smallest prefix whose mass reaches top_p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return logits.masked_fill(~keep, float("-inf"))


def scale_by_temperature(
    logits: torch.Tensor, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits / temperature, which rows are greedy): greedy rows (temperature 0) are scaled by 1,
    so their log-probs are log softmax(logits). logits (B, ..., V), temperature (B,)."""
    greedy = temperature <= 0
    if bool((temperature == 1).all()):  # dividing by 1 changes no bit: skip a pass over (B, V)
        return logits.float(), greedy
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    return tempered(logits, t.reshape(-1, *([1] * (logits.dim() - 1)))), greedy


class Uniforms:
    """A request's uniforms for `draw`, read from its generator `block` at a time: the same
    numbers in the same order as one `torch.rand((), generator=g)` a draw (a CPU generator fills
    a block element by element), without a torch call per row and token. Only for a generator
    that nothing else draws from (the engine's requests without speculative decoding)."""

    def __init__(self, generator: torch.Generator, block: int) -> None:
        self.generator, self.block = generator, max(1, block)
        self._ahead: list[float] = []

    def next(self) -> float:
        if not self._ahead:
            self._ahead = torch.rand(self.block, generator=self.generator).tolist()[::-1]
        return self._ahead.pop()


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator] | Sequence[Uniforms]) -> torch.Tensor:
    """One token per row of probs (B, V), row b with generator b (or its `Uniforms`), by inverting
    the CDF at one uniform: exact (a token of zero mass is never drawn), on CPU whatever the
    device of `probs`, so the same seed draws the same token from the same probabilities anywhere."""
    cdf = probs.float().cpu().cumsum(-1)
    if generators and isinstance(generators[0], Uniforms):
        u = torch.tensor([g.next() for g in generators], dtype=torch.float32)
    else:
        u = torch.stack([torch.rand((), generator=g) for g in generators])
    u = u * cdf[:, -1]
    picked = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]  # first index whose cdf exceeds u
    over = picked >= probs.shape[-1]  # u rounded up to the total: the last token of nonzero mass
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs[over].cpu().flip(-1) > 0).to(torch.int8).argmax(-1)
        picked[over] = last
    return picked


def sample_tokens(
    logits: torch.Tensor,  # (B, V) fp32, raw
    temperature: torch.Tensor,  # (B,)
    top_k: torch.Tensor,  # (B,) int
    top_p: torch.Tensor,  # (B,)
    generators: list[torch.Generator] | list[Uniforms],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), logprobs (B,)) with logprobs under softmax(logits / temperature); each
    sampled row draws one number from its generator (`draw`), greedy rows take the argmax."""
    scaled, greedy = scale_by_temperature(logits, temperature)
    logprobs_all = scaled.log_softmax(-1)
    if bool(greedy.all()):
        tokens = logits.argmax(-1)
    else:
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):  # the sort costs ~25% at 49k vocab
            probs = allowed_logits(scaled, top_k, top_p).softmax(-1)
        else:
            probs = logprobs_all.exp()
        tokens = draw(probs, generators).to(logits.device)
        if bool(greedy.any()):
            tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


class Sampler:
    """The engine's sampler: each running request's next token from its own parameters and its
    own generator. Sampling parameters are kept as tensors while the same requests run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cached: tuple[list, tuple[torch.Tensor, ...]] | None = None

    def params(self, requests: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p) per request (objects with `.params`); reused while the same
        requests run."""
        cached = self._cached
        if (
            cached is not None
            and len(cached[0]) == len(requests)
            and all(map(operator.is_, cached[0], requests))
        ):
            return cached[1]
        params = [r.params for r in requests]
        made = (
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device),
            torch.tensor([p.top_k for p in params], device=self.device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
        )
        self._cached = (list(requests), made)
        return made

    def sample(
        self, logits: torch.Tensor, requests: list, generators: list[torch.Generator] | list[Uniforms]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, log-probs) for each row of `logits` (B, V)."""
        return sample_tokens(logits, *self.params(requests), generators)


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    sample: Sample | None = None  # filled in place when given (keeps prompt, label, metadata)
    # vision-language: the processor's pixel_values and image_grid_thw for the prompt's image tokens
    images: dict[str, torch.Tensor] | None = None
    uid: int = -1
    arrival: int = -1  # set by the engine: how many requests came before this one
