"""What a request's caller sees after each step: `RequestOutput`, made by the `OutputProcessor` from the
request's tokens: when it finishes (EOS, `stop_token_ids`, stop strings, `max_tokens`, `min_tokens`
holding them back), its text (stop strings cut, incomplete characters held back; an id the tokenizer
lacks has none), the log-probabilities of its tokens and, once, of its prompt.

The engine calls `add` when a request with text is queued, `append` for each sampled token, `output`
after each step and `forget` when a request is aborted. Imports kvq.runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvq.runtime.detokenizer import CompletionText
from kvq.runtime.logprobs import LogprobRecorder, TokenLogprob, TokenTexts, prompt_entries
from kvq.runtime.prompt_logprobs import PromptScores
from kvq.runtime.request import Request


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: all tokens and text so far, and `delta`, the text new since the
    previous output (stop strings are cut from `text`; held-back characters come with a later delta)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta: str
    finished: bool
    finish_reason: str | None
    error: str | None
    logprobs: list[TokenLogprob] | None = None  # tokens new since the previous output (if asked)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's (first output; if asked)


class OutputProcessor:
    """Per request id: its text, and its prompt's log-probabilities until its next output;
    `record_logprobs` is the engine token hook that records sampled tokens' log-probabilities."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.texts: dict[int, CompletionText] = {}
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self.token_texts = TokenTexts(tokenizer)
        self.logprobs = LogprobRecorder(self.token_texts)

    def add(self, seq: Request) -> None:
        """A request whose tokens become text (scored requests are queued without)."""
        params = seq.params
        self.texts[seq.seq_id] = CompletionText(
            self.tokenizer,
            params.stop,
            skip_special_tokens=params.skip_special_tokens,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        if params.logprobs is not None and params.max_tokens > 0:
            self.logprobs.watch(seq.seq_id, params.logprobs)

    def record_logprobs(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        """The engine token hook: log-probabilities of the step's tokens, for the requests that asked."""
        if self.logprobs.num_top:
            self.logprobs(seqs, logits, token_ids)

    def forget(self, seq_id: int) -> None:
        self.texts.pop(seq_id, None)
        self.prompt_logprobs.pop(seq_id, None)
        self.logprobs.forget(seq_id)

    def keep_prompt_scores(self, seqs: list[Request], scores: dict[int, PromptScores]) -> None:
        """A prefill's prompt scores (by row of `seqs`), as entries for each request's next output."""
        for row, rows_scores in scores.items():
            seq = seqs[row]
            seq.needs_prompt_logprobs = False
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            self.prompt_logprobs[seq.seq_id] = prompt_entries(self.token_texts, prompt, rows_scores)

    def append(self, seq: Request, token_id: int) -> None:
        """Add a sampled token to `seq` and set its finish reason if this token ends it."""
        params = seq.params
        if params.max_tokens == 0:  # a prompt scored, nothing generated
            seq.finish_reason = "length"
            return
        seq.token_ids.append(token_id)
        num_generated = seq.num_tokens - seq.num_prompt_tokens
        can_stop = num_generated >= params.min_tokens
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if can_stop and (is_eos or token_id in params.stop_token_ids):
            seq.finish_reason = "stop"
        elif num_generated >= params.max_tokens or seq.num_tokens >= seq.max_len:
            seq.finish_reason = "length"
        text = self.texts.get(seq.seq_id)
        if text is not None and text.add(token_id, is_last=seq.finish_reason is not None, can_stop=can_stop):
            seq.finish_reason = "stop"

    def output(self, seq: Request) -> RequestOutput:
        """`seq`'s output now; a finished request is forgotten."""
        is_finished = seq.finish_reason is not None
        text = self.texts.pop(seq.seq_id, None) if is_finished else self.texts.get(seq.seq_id)
        shown, delta = ("", "") if text is None else text.take(is_finished)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = self.logprobs.take(seq.seq_id)
            if is_finished:
                self.logprobs.forget(seq.seq_id)
        return RequestOutput(
            seq.seq_id,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.completion_token_ids,
            shown,
            delta,
            is_finished,
            seq.finish_reason,
            seq.error,
            logprobs,
            self.prompt_logprobs.pop(seq.seq_id, None),
        )
