"""Log-probabilities of sampled tokens, from the distribution the engine samples from.

`LogprobRecorder` is an engine token hook: for the requests that asked (`SamplingParams.logprobs`), it
takes log_softmax of the step's logits in fp32 (the model's own distribution, before temperature, top-k and
top-p, as vLLM's default `raw_logprobs`) and keeps the sampled token's log-probability and rank and the
most likely tokens', each with its text. Requests that did not ask cost one dict lookup per step.
`prompt_entries` turns a prefill's `PromptScores` into the same entries (the first prompt token: None).
A token's text is its decode alone ("" for an id the tokenizer lacks), cached per id (`TokenTexts`).
Imports torch and kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvq.runtime.prompt_logprobs import PromptScores
from kvq.runtime.request import Request


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
    logprob: float | None  # None: a prompt's first token (nothing came before it)
    top: tuple[TopLogprob, ...]
    rank: int | None = 1  # 1 + how many tokens were more likely


class TokenTexts:
    """Each token id's text alone (what OpenAI's `token` fields show), decoded once and cached; an id the
    tokenizer lacks (an embedding padded past the tokenizer) is ""."""

    def __init__(self, tokenizer: Any) -> None:  # anything with batch_decode(list of id lists)
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        new = sorted({t for t in token_ids if t not in self.texts})
        if new:
            self.texts.update(zip(new, self.tokenizer.batch_decode([[t] for t in new]), strict=True))
        return [self.texts[t] for t in token_ids]


def prompt_entries(texts: TokenTexts, prompt_ids: list[int], scores: PromptScores) -> list[TokenLogprob]:
    """One entry per prompt token; the first has no log-probability (nothing came before it), as OpenAI
    and vLLM show it (`null`)."""
    logprobs, ranks = scores.token_logprobs.tolist(), scores.ranks.tolist()
    top_ids, top_values = scores.top_ids.tolist(), scores.top_logprobs.tolist()
    token_texts = texts(prompt_ids)
    entries = [TokenLogprob(prompt_ids[0], token_texts[0], None, (), None)]
    for i, (logprob, rank) in enumerate(zip(logprobs, ranks, strict=True)):
        ids = top_ids[i]
        top = tuple(map(TopLogprob, ids, texts(ids), top_values[i]))
        entries.append(TokenLogprob(prompt_ids[i + 1], token_texts[i + 1], logprob, top, rank))
    return entries


class LogprobRecorder:
    """Token hook; `watch(seq_id, num_top)` when a request that asked is queued, `take(seq_id)` gives the
    entries new since the last take, `forget(seq_id)` when the request is gone."""

    def __init__(self, texts: TokenTexts) -> None:
        self.texts = texts
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

    def __call__(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        if not self.num_top:
            return
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.num_top]
        if not rows:
            return
        log_probs = torch.log_softmax(logits[rows].float(), dim=-1)  # [R, V]
        k = max(self.num_top[seqs[i].seq_id] for i in rows)
        top_values, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
        chosen_ids = torch.tensor([token_ids[row] for row in rows])
        chosen = log_probs.gather(1, chosen_ids[:, None])  # [R, 1]
        ranks = ((log_probs > chosen).sum(dim=1) + 1).tolist()
        for r, row in enumerate(rows):
            seq_id, token_id = seqs[row].seq_id, token_ids[row]
            n = self.num_top[seq_id]
            ids = top_ids[r, :n].tolist()
            top = tuple(
                TopLogprob(t, text, v)
                for t, text, v in zip(ids, self.texts(ids), top_values[r, :n].tolist(), strict=True)
            )
            text = self.texts([token_id])[0]
            self.entries[seq_id].append(TokenLogprob(token_id, text, float(chosen[r, 0]), top, ranks[r]))
