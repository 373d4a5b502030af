"""What a request's caller sees after each step: `RequestOutput`, made by the `OutputProcessor` from the
request's tokens: when it finishes (EOS, `stop_token_ids`, stop strings, `max_tokens`, `min_tokens`
holding them back), its text (stop strings cut, incomplete characters held back; an id the tokenizer
lacks has none), the log-probabilities of its tokens and, once, of its prompt.

The engine calls `add` when a request with text is queued, `run_token_hooks` and `append_token` for each
step's sampled tokens, `output` after each step and `forget` when a request is aborted. A request whose
own output handling fails (a token hook, its text, stop strings, logprobs) ends alone, with finish reason
"error" (`guarded`: the error is logged and names the request); the rest of the step goes on.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvq.runtime.detokenizer import CompletionText
from kvq.runtime.logprobs import LogprobRecorder, TokenLogprob, TokenTexts, prompt_entries
from kvq.runtime.prompt_logprobs import PromptScores
from kvq.runtime.request import Request

# Called after each step's sampling with (the step's sequences, their logits [B, V] (bf16 or fp32), the
# sampled token ids): a hook may read the logits and replace token ids (teacher forcing,
# `kvq.runtime.scoring`).
TokenHook = Callable[[list[Request], torch.Tensor, list[int]], None]
logger = logging.getLogger("kvq")


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
    """Per request id: its text, and its prompt's log-probabilities until its next output; the engine's
    token hooks (`Engine.token_hooks`), the first of them `record_logprobs`, which records sampled tokens'
    log-probabilities."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self.texts: dict[int, CompletionText] = {}
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}
        self.token_texts = TokenTexts(tokenizer)
        self.logprobs = LogprobRecorder(self.token_texts)
        self.token_hooks: list[TokenHook] = [self.record_logprobs]

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

    def run_token_hooks(
        self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int], errors: list[str | None]
    ) -> None:
        """Every hook over the step; a hook that fails is run again request by request, so that only the
        requests it fails on end (their error set in `errors`)."""
        for hook in self.token_hooks:
            try:
                hook(seqs, logits, token_ids)
                continue
            except Exception:
                pass
            for row, seq in enumerate(seqs):
                one = [token_ids[row]]
                error = guarded(seq, partial(hook, [seq], logits[row : row + 1], one))
                token_ids[row] = one[0]
                if error is not None and errors[row] is None:
                    errors[row] = error

    def append_token(self, seq: Request, token_id: int, error: str | None = None) -> None:
        """Append a sampled token to `seq` (`append`: text, stops, logprobs), unless `error` (its
        sampling's) or its output handling failing stops that request alone."""
        if error is None:
            error = guarded(seq, partial(self.append, seq, token_id))
        if error is not None:
            stop(seq, error)

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


def guarded(seq: Request, work: Callable[[], object]) -> str | None:
    """Run one request's share of the step's output handling; the error that ends it, or None."""
    try:
        work()
    except Exception as e:
        logger.exception("request %d: its output handling failed; it is stopped", seq.seq_id)
        return f"output handling failed ({type(e).__name__}: {e})"
    return None


def stop(seq: Request, error: str) -> None:
    """End `seq` with finish reason "error" (the scheduler frees it when the step finishes it)."""
    seq.finish_reason = "error"
    seq.error = f"{error} at position {seq.num_tokens}; the request was stopped"
