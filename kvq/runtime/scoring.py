"""Teacher-forced scoring: the engine decodes given tokens instead of sampled ones and sums their NLL.

`perplexity(engine, windows)` is what `kvq eval` reports: every prediction comes from a decode step that
reads the earlier tokens' K/V from the paged pool, as serving does. `TeacherForcing` is the engine's
token hook that does it.
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
    forcing = TeacherForcing()
    seqs = []
    for window in windows:
        seq = engine.make_sequence([window[0]], SamplingParams(max_tokens=len(window) - 1, ignore_eos=True))
        forcing.forced[seq.seq_id] = list(window[1:])
        seqs.append(seq)
        engine.scheduler.add(seq)  # no text: scored tokens are not read
    engine.token_hooks.append(forcing)
    try:
        while any(s.finish_reason is None for s in seqs):
            engine.step()
    finally:
        engine.token_hooks.remove(forcing)
    if any(s.finish_reason != "length" for s in seqs):
        errors = sorted({f"{s.finish_reason}: {s.error}" for s in seqs if s.finish_reason != "length"})
        raise KvqError(f"a perplexity window stopped early ({'; '.join(errors)})")
    return math.exp(sum(forcing.nll.values()) / sum(len(w) - 1 for w in windows))


class TeacherForcing:
    """An engine token hook: forced requests take their next given token (not the sampled one) and add
    its negative log-likelihood under the step's logits. State by request id."""

    def __init__(self) -> None:
        self.forced: dict[int, list[int]] = {}  # request id -> the completion to append
        self.nll: dict[int, float] = {}  # request id -> sum of -log p(forced token) so far

    def __call__(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.forced]
        if not rows:
            return
        log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
        for row, log_prob in zip(rows, log_probs, strict=True):
            seq = seqs[row]
            token_ids[row] = self.forced[seq.seq_id][seq.num_tokens - seq.num_prompt_tokens]
            self.nll[seq.seq_id] = self.nll.get(seq.seq_id, 0.0) - float(log_prob[token_ids[row]])
