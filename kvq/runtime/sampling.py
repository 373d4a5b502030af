"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, and
what a request's penalties, logit bias and `min_tokens` do to its row of logits.

A request with a seed draws from its own generator, so its tokens do not depend on what it is batched
with. The logit adjustments are OpenAI's `logit_bias` and presence/frequency penalties (over the
completion's tokens), vLLM's and transformers' `repetition_penalty` (over prompt and completion: a
positive logit divided by it, a negative one multiplied) and vLLM's `min_tokens` (EOS and
`stop_token_ids` masked until that many tokens were generated); rows of requests that ask for none of
them are never touched. A row with non-finite logits, or one that cannot be sampled, is reported by its
error, not sampled: only that request ends. Imports torch, kvq.errors and the C argmax
(kvq.runtime.kernels.cpu_ops).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvq.errors import KvqError
from kvq.runtime.kernels.cpu_ops import argmax_finite

if TYPE_CHECKING:
    from kvq.runtime.sequence import Sequence

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit
GREEDY_BELOW = 1e-5  # a smaller temperature is greedy (vLLM's): dividing by it would overflow the logits


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off; `stop` strings end the text (not
    included unless `include_stop_str_in_output`). The penalties, `logit_bias` and `min_tokens` are vLLM's
    and OpenAI's: presence/frequency over the completion's tokens, repetition (x or / per token, as
    transformers) over prompt and completion; `min_tokens` holds back EOS, `stop_token_ids` and stop
    strings. `max_tokens` 0 generates nothing (with `prompt_logprobs`: score a prompt)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # log-probabilities of sampled tokens, with this many top ones (None: off)
    prompt_logprobs: int | None = None  # the same over the prompt's tokens (None: off)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (0 <= self.min_tokens, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for value, name in ((self.presence_penalty, "presence"), (self.frequency_penalty, "frequency")):
            checks.append((-2.0 <= value <= 2.0, f"{name}_penalty must be in [-2, 2], got {value}"))
        for top, name in ((self.logprobs, "logprobs"), (self.prompt_logprobs, "prompt_logprobs")):
            in_range = top is None or 0 <= top <= MAX_TOP_LOGPROBS
            checks.append((in_range, f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (top tokens), got {top}"))
        for is_valid, message in checks:
            if not is_valid:
                raise KvqError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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


def filter_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """One row of probabilities `[V]`: tokens below `min_p` times the most likely one's set to 0."""
    return probs.masked_fill(probs < min_p * probs.max(), 0.0) if min_p > 0 else probs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    processed: dict[int, torch.Tensor] | None = None,
) -> tuple[list[int], list[str | None]]:
    """Logits `[B, V]` (fp32 or bf16) -> (token id per row, the row's error or None). The greedy tokens
    come from the logits as they are (bf16 -> fp32 is exact); a sampled row is made fp32. `processed`
    replaces rows (row -> fp32 `[V]`) that a request's penalties or bias changed."""
    logits = logits.cpu()
    greedy, finite = argmax_finite(logits)
    tokens = greedy.tolist()
    errors: list[str | None] = [None if ok else "non-finite logits" for ok in finite.tolist()]
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        row_logits = (processed or {}).get(row)
        if errors[row] is not None or (p.is_greedy and row_logits is None):
            continue
        try:
            tokens[row] = _sample_row(logits[row] if row_logits is None else row_logits, p, gen)
        except RuntimeError as e:  # e.g. every token filtered or masked out
            errors[row] = f"sampling failed ({e})"
    return tokens, errors


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    if p.is_greedy:
        return int(logits.argmax())
    filtered = filter_logits(logits.float() / p.temperature, p.top_k, p.top_p)
    probs = filter_min_p(filtered.softmax(-1), p.min_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def needs_processing(params: SamplingParams) -> bool:
    return bool(
        params.logit_bias
        or params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.min_tokens
    )


def process_row(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    completion_ids: list[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """One row `[V]` -> a new fp32 row with the request's bias, penalties and `min_tokens` mask applied."""
    row = logits.float().clone()
    vocab = row.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(completion_ids)), dtype=torch.int64)
        seen = seen[seen < vocab]
        values = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.presence_penalty or params.frequency_penalty) and completion_ids:
        ids = torch.tensor(list(completion_ids), dtype=torch.int64)
        counts = torch.bincount(ids, minlength=vocab)[:vocab]
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if len(completion_ids) < params.min_tokens:
        held = {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
        held_ids = [t for t in held if 0 <= t < vocab]
        if held_ids:
            row[held_ids] = float("-inf")
    return row


def sample_requests(
    seqs: list[Sequence], logits: torch.Tensor, eos_token_ids: Collection[int]
) -> tuple[list[int], list[str | None]]:
    """Each request's next token from its row of `logits` `[B, V]`, or the error that ends it (its
    penalties or its sampling failed: only that request)."""
    processed: dict[int, torch.Tensor] = {}
    failed: dict[int, str] = {}
    for row, seq in enumerate(seqs):
        if needs_processing(seq.params):
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            try:
                processed[row] = process_row(
                    logits[row], seq.params, prompt, seq.completion_token_ids, eos_token_ids
                )
            except Exception as e:  # one request's parameters: that request alone ends
                failed[row] = f"its logits processing failed ({type(e).__name__}: {e})"
    token_ids, errors = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], processed)
    return token_ids, [failed.get(row, e) for row, e in enumerate(errors)]
