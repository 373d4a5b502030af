"""Log-probabilities of a prompt's own tokens, from the prefill that computes its K/V (vLLM's
`prompt_logprobs`, OpenAI's `echo` with `logprobs`).

The prefill's hidden states of a prompt's rows go through the model's own lm_head (INT4/INT8/BF16 as
loaded; every tensor-parallel rank joins, as for the step's logits) a chunk of rows at a time, so memory
stays bounded by `CHUNK_ELEMENTS` fp32 logits however long the prompt: no `[tokens, vocab]` tensor. A
request that asks is prefilled whole (it takes no prefix-cache hits, `BlockManager.allocate`): the rows of
a cached page were never computed, and recomputing them is what makes a cached prompt score the same as
an uncached one. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 22  # fp32 logits per chunk (16 MiB)


@dataclass(frozen=True)
class PromptScores:
    """One prompt of n tokens: row i scores token i + 1 given tokens 0..i (the first token has none)."""

    token_logprobs: torch.Tensor  # [n - 1] fp32
    ranks: torch.Tensor  # [n - 1] int64: 1 + how many tokens were more likely
    top_ids: torch.Tensor  # [n - 1, num_top] int64, most likely first
    top_logprobs: torch.Tensor  # [n - 1, num_top] fp32


def score_prompt(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    num_top: int,
    vocab_size: int,
) -> PromptScores:
    """`hidden` `[n, H]`: the prefill's final hidden states of a prompt's `token_ids` `[n]`."""
    num_rows = max(1, CHUNK_ELEMENTS // vocab_size)
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0] - 1, num_rows):
        end = min(start + num_rows, hidden.shape[0] - 1)
        log_probs = torch.log_softmax(compute_logits(hidden[start:end]).float(), dim=-1)  # [r, V]
        chosen = log_probs.gather(1, token_ids[start + 1 : end + 1, None].to(log_probs.device))  # [r, 1]
        ranks = (log_probs > chosen).sum(dim=1) + 1
        top = log_probs.topk(num_top, dim=-1)
        parts.append((chosen[:, 0], ranks, top.indices, top.values))
    if not parts:  # a one-token prompt: nothing to score
        empty = torch.empty(0, num_top)
        return PromptScores(torch.empty(0), torch.empty(0, dtype=torch.int64), empty.long(), empty)
    return PromptScores(*(torch.cat([p[i] for p in parts]).cpu() for i in range(4)))
