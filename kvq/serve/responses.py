"""OpenAI response bodies (plain dicts): completions and chat, whole or as stream chunks, with `usage`
and `logprobs` in OpenAI's two formats (completions: parallel lists; chat: one object per token).
Imports kvq.runtime (for types) only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvq.runtime.engine import RequestOutput
from kvq.runtime.logprobs import TokenLogprob


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
        "top_logprobs": [{**{t.token: t.logprob for t in e.top}, e.token: e.logprob} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    def one(token: str, logprob: float) -> dict:
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
    created: int = field(default_factory=lambda: int(time.time()))
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters streamed so far

    def completion(self, outs: Sequence[RequestOutput], echoes: Sequence[str], usage: dict) -> dict:
        choices = []
        for index, (out, echo) in enumerate(zip(outs, echoes, strict=True)):
            logprobs = None if out.logprobs is None else completion_logprobs(out.logprobs, len(echo))
            choices.append(
                {
                    "index": index,
                    "text": echo + out.text,
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
            )
        return self._body("text_completion", choices, usage)

    def completion_chunk(self, index: int, out: RequestOutput, echo: str = "") -> dict:
        text = echo + out.delta
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(out.logprobs, self.text_offsets.get(index, 0) + len(echo))
        self.text_offsets[index] = self.text_offsets.get(index, 0) + len(text)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
        return self._chunk("text_completion", choice)

    def chat(self, outs: Sequence[RequestOutput], usage: dict) -> dict:
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None if out.logprobs is None else chat_logprobs(out.logprobs),
                "finish_reason": out.finish_reason,
            }
            for index, out in enumerate(outs)
        ]
        return self._body("chat.completion", choices, usage)

    def chat_chunk(self, index: int, delta: dict, out: RequestOutput | None = None) -> dict:
        logprobs = None if out is None or out.logprobs is None else chat_logprobs(out.logprobs)
        finish_reason = None if out is None else out.finish_reason
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk("chat.completion.chunk", choice)

    def usage_chunk(self, kind: str, usage: dict) -> dict:
        """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
        return self._body(kind, [], usage)

    def _chunk(self, kind: str, choice: dict) -> dict:
        body = self._body(kind, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def _body(self, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return {**body, "choices": choices, **({"usage": usage} if usage is not None else {})}
