"""OpenAI response bodies (plain dicts): completions and chat, whole or as stream chunks, with `usage`
and `logprobs` in OpenAI's two formats (completions: parallel lists; chat: one object per token), the
prompt's own log-probabilities (completions' `echo`: the same lists over prompt + completion, the first
prompt token `null`; vLLM's `prompt_logprobs`: a list of `{token_id: {logprob, rank, decoded_token}}`),
and vLLM's `continuous_usage_stats` (usage in every chunk). Imports kvq.runtime (for types) only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvq.runtime.logprobs import TokenLogprob
from kvq.runtime.outputs import RequestOutput


def usage(prompt_lens: Sequence[int], outs: Sequence[RequestOutput]) -> dict:
    """Prompt tokens once per prompt (its n choices share it, as vLLM counts), completion tokens of all."""
    prompt, completion = sum(prompt_lens), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(entries: Sequence[TokenLogprob], text_offset: int) -> dict:
    """Completions' format; `text_offset` is where the first token's text starts in the choice's text."""
    offsets = []
    for entry in entries:
        offsets.append(text_offset)
        text_offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            None if e.logprob is None else {**{t.token: t.logprob for t in e.top}, e.token: e.logprob}
            for e in entries
        ],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(entries: Sequence[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or its top tokens and itself by id."""

    def one(e: TokenLogprob) -> dict | None:
        if e.logprob is None:
            return None
        top = {
            str(t.token_id): {"logprob": t.logprob, "rank": r, "decoded_token": t.token}
            for r, t in enumerate(e.top, 1)
        }
        return {**top, str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.token}}

    return [one(e) for e in entries]


@dataclass(frozen=True)
class PromptLogprobs:
    """What a completions request asked of its prompt's log-probabilities."""

    is_echoed: bool = False  # `echo` with `logprobs`: in the choice's `logprobs`, before the completion's
    is_vllm: bool = False  # `prompt_logprobs`: vLLM's list in the choice


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    def one(token: str, logprob: float | None) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t.token, t.logprob) for t in e.top]}
            for e in entries
        ]
    }


@dataclass
class Reply:
    """The response bodies of one request: `id`, `created` and `model` in each (OpenAI's envelope);
    `include_usage`: stream chunks carry `usage: null` and a last chunk the usage."""

    request_id: str
    model: str
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries its usage
    prompt: PromptLogprobs = PromptLogprobs()
    created: int = field(default_factory=lambda: int(time.time()))
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters streamed so far

    def completion(self, outs: Sequence[RequestOutput], echoes: Sequence[str], usage: dict) -> dict:
        choices = [
            self._completion_choice(index, out, echo, echo + out.text, 0)
            for index, (out, echo) in enumerate(zip(outs, echoes, strict=True))
        ]
        return self._body("text_completion", choices, usage)

    def completion_chunk(
        self, index: int, out: RequestOutput, echo: str = "", usage: dict | None = None
    ) -> dict:
        text = echo + out.delta
        choice = self._completion_choice(index, out, echo, text, self.text_offsets.get(index, 0))
        self.text_offsets[index] = self.text_offsets.get(index, 0) + len(text)
        return self._chunk("text_completion", choice, usage)

    def _completion_choice(self, index: int, out: RequestOutput, echo: str, text: str, offset: int) -> dict:
        """`out`'s choice; with `echo` and logprobs its first output's logprobs start with the prompt's."""
        entries = list(out.logprobs) if out.logprobs is not None else None
        prompt_entries = out.prompt_logprobs or []
        if self.prompt.is_echoed and prompt_entries:
            entries = prompt_entries + (entries or [])
            offset -= len(echo)  # the prompt's tokens start at the echo's start
        logprobs = None if entries is None else completion_logprobs(entries, offset + len(echo))
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        if self.prompt.is_vllm and prompt_entries:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_entries)
        return choice

    def chat(self, outs: Sequence[RequestOutput], usage: dict, with_prompt_logprobs: bool = False) -> dict:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None if out.logprobs is None else chat_logprobs(out.logprobs),
                "finish_reason": out.finish_reason,
            }
            for index, out in enumerate(outs)
        ]
        body = self._body("chat.completion", choices, usage)
        if with_prompt_logprobs and outs and outs[0].prompt_logprobs:
            body["prompt_logprobs"] = vllm_prompt_logprobs(outs[0].prompt_logprobs)  # vLLM: one per request
        return body

    def chat_chunk(
        self, index: int, delta: dict, out: RequestOutput | None = None, usage: dict | None = None
    ) -> dict:
        logprobs = None if out is None or out.logprobs is None else chat_logprobs(out.logprobs)
        finish_reason = None if out is None else out.finish_reason
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk("chat.completion.chunk", choice, usage)

    def usage_chunk(self, kind: str, usage: dict) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return self._body(kind, [], usage)

    def _chunk(self, kind: str, choice: dict, usage: dict | None = None) -> dict:
        body = self._body(kind, [choice])
        if self.continuous_usage and usage is not None:
            body["usage"] = usage
        elif self.include_usage:
            body["usage"] = None
        return body

    def _body(self, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **({"usage": usage} if usage is not None else {})}
