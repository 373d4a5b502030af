"""What one request may ask for: prompt length, max_tokens and the context, and room in the queue.

Checked in the handler before the engine sees the request, with the numbers and the field in each
message (a context overflow reads as vLLM's). Imports kvq.serve only.
"""

from __future__ import annotations

from kvq.serve.api_errors import ApiError
from kvq.serve.server_config import ServerConfig


def max_tokens_for(
    num_prompt_tokens: int,
    requested: int | None,
    default: int,
    max_model_len: int,
    config: ServerConfig,
    prompt_field: str,
    minimum: int = 1,
) -> int:
    """The request's max_tokens: `requested`, else `default` capped by the context left after the prompt;
    `ApiError` 400 when the prompt or max_tokens is over the server's limits or the two overflow the
    context. `minimum` 0 lets a completions request score its prompt only (`echo` with `logprobs`)."""
    if config.max_prompt_tokens is not None and num_prompt_tokens > config.max_prompt_tokens:
        raise ApiError(
            400,
            f"{prompt_field} has {num_prompt_tokens} tokens; this server takes at most "
            f"{config.max_prompt_tokens} (--max-prompt-tokens); shorten it",
            param=prompt_field,
        )
    if requested is None:
        requested = max(1, min(default, max_model_len - num_prompt_tokens))
    elif requested < minimum:
        raise ApiError(400, f"max_tokens must be >= {minimum}, got {requested}", param="max_tokens")
    if config.max_completion_tokens is not None and requested > config.max_completion_tokens:
        raise ApiError(
            400,
            f"max_tokens is {requested}; this server generates at most {config.max_completion_tokens} "
            "tokens per request (--max-completion-tokens); lower it",
            param="max_tokens",
        )
    if num_prompt_tokens + requested > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {prompt_field}, "
            f"{requested} in the completion). Please reduce the length of the {prompt_field} or completion.",
            param=prompt_field if num_prompt_tokens >= max_model_len else "max_tokens",
        )
    return requested


def check_queue(num_waiting: int, num_new: int, config: ServerConfig) -> None:
    """`ApiError` 429 with Retry-After when `num_new` more requests would pass `--max-waiting`."""
    if config.max_waiting is not None and num_waiting + num_new > config.max_waiting:
        raise ApiError(
            429,
            f"the server's queue is full ({num_waiting} requests waiting, --max-waiting "
            f"{config.max_waiting}); retry after {config.retry_after} s",
            code="queue_full",
            headers={"Retry-After": str(config.retry_after)},
        )
