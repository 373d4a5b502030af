"""The OpenAI API subset kvq serves: request bodies, validated, and what they ask of the engine.

Fields follow OpenAI's completions and chat completions APIs, with vLLM's `top_k` and `ignore_eos`
extensions. Defaults are OpenAI's (temperature 1, top_p 1, n 1; completions max_tokens 16), except
chat's max_tokens, which is the server's `--max-tokens` capped by the context left after the prompt
(OpenAI's "as many as fit" would reserve the whole context in KV pages). Fields kvq does not implement
are refused by name rather than ignored. Imports pydantic and kvq.runtime.sampling.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvq.errors import KvqError
from kvq.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("kvq does not implement presence or frequency penalties; send 0 or leave it out")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """One `SamplingParams` per choice (choice i of a seeded request draws from seed + i, as vLLM);
        `KvqError` for out-of-range values (max_tokens < 1, temperature < 0, ...)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [
            SamplingParams(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=None if self.seed is None else self.seed + i,
                max_tokens=max_tokens,
                stop=stop,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
            for i in range(self.n)
        ]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError(
                "echo with logprobs asks for the prompt's log-probabilities, which kvq does not compute; "
                "send one of them"
            )
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send at least one prompt")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One or several prompts (OpenAI's batch form: a list of strings or of token id lists)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise KvqError(f"model {requested!r} is not served here; this server serves {served!r}")
