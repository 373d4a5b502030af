"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds, and
what a request's penalties, logit bias and `min_tokens` do to its row of logits.

A request with a seed draws from its own generator, so its tokens do not depend on what it is batched
with. The logit adjustments are OpenAI's `logit_bias` and presence/frequency penalties (over the
completion's tokens), vLLM's and transformers' `repetition_penalty` (over prompt and completion: a
positive logit divided by it, a negative one multiplied) and vLLM's `min_tokens` (EOS and
`stop_token_ids` masked until that many tokens were generated); rows of requests that ask for none of
them are never touched. A row with non-finite logits, or one that cannot be sampled, is reported by its
error, not sampled: only that request ends. The parameters themselves are `kvq.runtime.sampling_params`
(no torch: a command line checks them before torch loads). Imports torch and the C argmax of CPU logits
(kvq.runtime.kernels.cpu.ops).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from kvq.runtime.kernels.cpu.ops import argmax_finite
from kvq.runtime.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["MAX_TOP_LOGPROBS", "SamplingParams", "make_generator", "sample", "sample_requests"]

if TYPE_CHECKING:
    from kvq.runtime.request import Request


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
    come from the logits as they are (bf16 -> fp32 is exact), where they are (CPU logits: kvq's C argmax); a
    sampled row is made fp32 on the host. `processed` replaces rows (row -> fp32 `[V]`) that a request's
    penalties or bias changed."""
    if logits.device.type == "cpu":
        greedy, finite = argmax_finite(logits)
    else:  # on the device (the same answer: each row's first maximum), before the rows come to the host
        greedy, finite = logits.argmax(dim=-1), logits.isfinite().all(dim=-1)
    logits = logits.cpu()
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
    seqs: list[Request], logits: torch.Tensor, eos_token_ids: Collection[int]
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
