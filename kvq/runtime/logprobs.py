"""Log-probabilities of sampled tokens, from the distribution the engine samples from.

`LogprobRecorder` is an engine token hook: for the requests that asked (`SamplingParams.logprobs`), it
takes log_softmax of the step's logits in fp32 (the model's own distribution, before temperature, top-k and
top-p, as vLLM's default `raw_logprobs`) and keeps the sampled token's log-probability and the most likely
tokens', each with its text. Requests that did not ask cost one dict lookup per step.
Imports torch and kvq.runtime.sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvq.runtime.sequence import Sequence


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # the token's text alone (what OpenAI's `token` field shows)
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token: its log-probability and the `top` most likely tokens of its step (most likely
    first; as many as the request asked)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...]


class LogprobRecorder:
    """Token hook; `watch(seq_id, num_top)` when a request that asked is queued, `take(seq_id)` gives the
    entries new since the last take, `forget(seq_id)` when the request is gone."""

    def __init__(self, tokenizer: Any) -> None:  # anything with decode(ids) -> str
        self.tokenizer = tokenizer
        self.num_top: dict[int, int] = {}  # request id -> top log-probabilities it wants per token
        self.entries: dict[int, list[TokenLogprob]] = {}  # request id -> not yet taken

    def watch(self, seq_id: int, num_top: int) -> None:
        self.num_top[seq_id] = num_top
        self.entries[seq_id] = []

    def forget(self, seq_id: int) -> None:
        self.num_top.pop(seq_id, None)
        self.entries.pop(seq_id, None)

    def take(self, seq_id: int) -> list[TokenLogprob] | None:
        """The entries new since the last take; None for a request that did not ask."""
        if seq_id not in self.entries:
            return None
        taken, self.entries[seq_id] = self.entries[seq_id], []
        return taken

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor, token_ids: list[int]) -> None:
        if not self.num_top:
            return
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.num_top]
        if not rows:
            return
        log_probs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
        k = max(self.num_top[seqs[i].seq_id] for i in rows)
        top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
        for r, row in enumerate(rows):
            seq_id, token_id = seqs[row].seq_id, token_ids[row]
            n = self.num_top[seq_id]
            top = tuple(
                TopLogprob(t, self.tokenizer.decode([t]), v)
                for t, v in zip(top_ids[r, :n].tolist(), top_values[r, :n].tolist(), strict=True)
            )
            self.entries[seq_id].append(
                TokenLogprob(token_id, self.tokenizer.decode([token_id]), float(log_probs[r, token_id]), top)
            )
