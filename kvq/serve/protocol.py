"""The OpenAI API subset kvq serves: request bodies (validated) and response bodies (plain dicts).

Fields follow OpenAI's completions and chat completions APIs, with vLLM's `top_k` extension. Defaults are
OpenAI's (temperature 1, top_p 1; completions max_tokens 16), except chat's max_tokens, which is the
server's `--max-tokens` (OpenAI's "as many as fit" would reserve the whole context in KV pages). Fields
kvq does not implement are refused by name rather than ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvq.errors import KvqError
from kvq.runtime.engine import RequestOutput
from kvq.runtime.sampling import SamplingParams


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("kvq serves n=1 only; send n requests instead")
        return n

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """`KvqError` for out-of-range values (max_tokens < 1, temperature < 0, ...)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=stop,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    def chat_max_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def usage(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass(frozen=True)
class Reply:
    """The response bodies of one request: `id`, `created` and `model` in each (OpenAI's envelope)."""

    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        return self._body("text_completion", choice, usage(out))

    def completion_chunk(self, out: RequestOutput) -> dict:
        choice = {"index": 0, "text": out.delta, "logprobs": None, "finish_reason": out.finish_reason}
        return self._body("text_completion", choice)

    def chat(self, out: RequestOutput) -> dict:
        message = {"role": "assistant", "content": out.text}
        return self._body(
            "chat.completion",
            {"index": 0, "message": message, "finish_reason": out.finish_reason},
            usage(out),
        )

    def chat_chunk(self, delta: dict, finish_reason: str | None) -> dict:
        return self._body(
            "chat.completion.chunk", {"index": 0, "delta": delta, "finish_reason": finish_reason}
        )

    def _body(self, kind: str, choice: dict, usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": kind, "created": self.created, "model": self.model}
        return {**body, "choices": [choice], **({"usage": usage} if usage is not None else {})}


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise KvqError(f"model {requested!r} is not served here; this server serves {served!r}")
