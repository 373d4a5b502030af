"""Teacher-forced scoring: the engine decodes given tokens instead of sampled ones and sums their NLL.

`perplexity(engine, windows)` is what `kvq eval` reports: every prediction comes from a decode step that
reads the earlier tokens' K/V from the paged pool, as serving does. `force_tokens` is the engine's hook.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvq.errors import KvqError
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.sequence import Sequence as Request

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine


def perplexity(engine: Engine, windows: Sequence[Sequence[int]]) -> float:
    """exp(mean next-token NLL) of token windows, every prediction made by a decode step that reads
    the earlier tokens' K/V from the paged pool (FP8 pages included), as serving does: each window is
    a one-token prompt whose completion is forced to the window's next tokens (teacher forcing)."""
    if not windows or any(len(w) < 2 for w in windows):
        raise KvqError("perplexity needs windows of at least 2 tokens")
    seqs = []
    for window in windows:
        seq = engine.make_sequence([window[0]], SamplingParams(max_tokens=len(window) - 1, ignore_eos=True))
        seq.forced_token_ids = list(window[1:])
        seqs.append(seq)
        engine.scheduler.add(seq)
    while any(s.finish_reason is None for s in seqs):
        engine.step()
    if any(s.finish_reason != "length" for s in seqs):
        errors = sorted({f"{s.finish_reason}: {s.error}" for s in seqs if s.finish_reason != "length"})
        raise KvqError(f"a perplexity window stopped early ({'; '.join(errors)})")
    return math.exp(sum(s.nll for s in seqs) / sum(len(w) - 1 for w in windows))


def force_tokens(seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
    """Teacher forcing: forced sequences take their next given token (not the sampled one) and add
    its negative log-likelihood under `logits`."""
    rows = [i for i, s in enumerate(seqs) if s.forced_token_ids is not None]
    if not rows:
        return
    log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
    for row, log_prob in zip(rows, log_probs, strict=True):
        seq = seqs[row]
        assert seq.forced_token_ids is not None
        token_ids[row] = seq.forced_token_ids[seq.num_tokens - seq.num_prompt_tokens]
        seq.nll -= float(log_prob[token_ids[row]])
