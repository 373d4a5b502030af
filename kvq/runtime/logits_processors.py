"""What a request's penalties, logit bias and `min_tokens` do to its next-token logits, one row at a time.

Pure functions over a row of logits `[V]`: OpenAI's `logit_bias` and presence/frequency penalties (over the
completion's tokens), vLLM's and transformers' `repetition_penalty` (over prompt and completion: a positive
logit divided by it, a negative one multiplied) and vLLM's `min_tokens` (EOS and `stop_token_ids` masked
until that many tokens were generated). Rows of requests that ask for none of them are never touched.
Imports torch and kvq.runtime.sampling.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from kvq.runtime.sampling import SamplingParams


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
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
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
