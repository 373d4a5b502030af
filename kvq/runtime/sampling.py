"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds.

A request with a seed draws from its own generator, so its tokens do not depend on what it is batched
with. Rows with non-finite logits are reported, not sampled. Imports torch, kvq.errors and the C argmax
(kvq.runtime.kernels.cpu_ops).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvq.errors import KvqError
from kvq.runtime.kernels.cpu_ops import argmax_finite

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 are off; `stop` strings end the text (not included)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probabilities of sampled tokens, with this many top ones (None: off)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise KvqError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise KvqError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvqError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise KvqError(f"top_k must be >= 0 (0 is off), got {self.top_k}")
        if any(not s for s in self.stop):
            raise KvqError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise KvqError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (top tokens), got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own generator when it has a seed (CPU: sampling runs on host logits)."""
    return None if params.seed is None else torch.Generator().manual_seed(params.seed)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row `[V]`: everything outside the top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        is_outside = cumulative - sorted_logits.softmax(-1) >= top_p  # keeps the token that crosses top_p
        logits = logits.index_put((order[is_outside],), torch.tensor(float("-inf")))
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[bool]]:
    """Logits `[B, V]` (fp32 or bf16) -> (token id per row, whether the row's logits were all finite). The
    greedy tokens come from the logits as they are (bf16 -> fp32 is exact); a sampled row is made fp32."""
    logits = logits.cpu()
    greedy, finite = argmax_finite(logits)
    tokens, is_finite = greedy.tolist(), finite.tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.is_greedy or not is_finite[row]:
            continue
        filtered = filter_logits(logits[row].float() / p.temperature, p.top_k, p.top_p)
        tokens[row] = int(torch.multinomial(filtered.softmax(-1), 1, generator=gen))
    return tokens, is_finite
