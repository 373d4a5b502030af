"""The request bodies kvq serves: OpenAI's completions and chat completions with vLLM's extensions.

Fields follow OpenAI's APIs and vLLM's additions to them (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `skip_special_tokens`,
`prompt_logprobs`, `stream_options.continuous_usage_stats`, ...), so tools written for vLLM work unchanged.
As in vLLM, a field this server does not know is ignored with one logged warning naming it; a field it
knows but cannot honour (`kvq.serve.unsupported`) is refused with a 400 naming it. Defaults are OpenAI's
(temperature 1, top_p 1, n 1; completions max_tokens 16), except chat's max_tokens, which is the server's
`--max-tokens` capped by the context left after the prompt. Imports pydantic and kvq.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvq.errors import KvqError
from kvq.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams
from kvq.serve.unsupported import HARMLESS, refuse_unsupported

log = logging.getLogger("kvq.serve")
MAX_N = 16  # choices per request
INT64 = 2**63


class _Open(BaseModel):
    """Unknown fields are kept aside (`model_extra`) and reported by `ignored_fields`, not refused."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self, prefix: str = "") -> list[str]:
        names = [prefix + name for name in self.model_extra or {}]
        for name, value in self:
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Open):
                    where = f"{name}[{i}]" if isinstance(value, list) else name
                    names += item.ignored_fields(f"{prefix}{where}.")
        return names


class StreamOptions(_Open):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class _Sampling(_Open):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 is off
    min_p: float | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _known_but_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            refuse_unsupported(data)
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids; {key!r} is not one")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage or self.continuous_usage))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def warn_ignored(self, route: str) -> None:
        """One warning per request naming the fields it sent that this server does not know (vLLM's way)."""
        ignored = [name for name in self.ignored_fields() if name not in HARMLESS]
        if ignored:
            log.warning("%s: ignoring fields kvq does not know: %s", route, ", ".join(sorted(ignored)))

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> list[SamplingParams]:
        """One `SamplingParams` per choice (choice i of a seeded request draws from seed + i, as vLLM);
        `KvqError` for out-of-range values (temperature < 0, top_p 0, ...)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        top_k = self.top_k or 0
        return [
            SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if top_k == -1 else top_k,
                min_p=self.min_p or 0.0,
                seed=None if self.seed is None else self.seed + i,
                max_tokens=max_tokens,
                min_tokens=min(self.min_tokens or 0, max_tokens),
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                ignore_eos=bool(self.ignore_eos),
                skip_special_tokens=self.skip_special_tokens is not False,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
            )
            for i in range(self.num_choices)
        ]

    def truncated(self, token_ids: list[int]) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: keep the prompt's last N tokens."""
        n = self.truncate_prompt_tokens
        return token_ids if n is None else token_ids[-n:]


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_special_tokens: bool | None = True

    @model_validator(mode="after")
    def _prompts_not_empty(self) -> CompletionRequest:
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

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top log-probabilities wanted per prompt token: `echo` with `logprobs`, or `prompt_logprobs`."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None


class ChatMessage(_Open):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise ValueError(f"role {role!r} is not one of system, user, assistant, developer, tool")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        for part in content if isinstance(content, list) else []:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type")
                raise ValueError(f"content parts of type {kind!r} are not supported: kvq serves text only")
        return content

    def as_template_message(self) -> dict[str, str]:
        content = self.content or ""
        text = content if isinstance(content, str) else "".join(p["text"] for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None

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
