"""A request's sampling parameters, validated on creation: the one source of their defaults, which
`kvq generate`'s flags and the server's request fields read. The sampler is `kvq.runtime.sampling`.
Imports kvq.errors only (a command line checks its flags with it before torch loads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvq.errors import KvqError

MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit
GREEDY_BELOW = 1e-5  # a smaller temperature is greedy (vLLM's): dividing by it would overflow the logits


@dataclass
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off; `stop` strings end the text (not
    included unless `include_stop_str_in_output`). The penalties, `logit_bias` and `min_tokens` are vLLM's
    and OpenAI's: presence/frequency over the completion's tokens, repetition (x or / per token, as
    transformers) over prompt and completion; `min_tokens` holds back EOS, `stop_token_ids` and stop
    strings. `max_tokens` 0 generates nothing (with `prompt_logprobs`: score a prompt)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # log-probabilities of sampled tokens, with this many top ones (None: off)
    prompt_logprobs: int | None = None  # the same over the prompt's tokens (None: off)

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be >= 0, got {self.max_tokens}"),
            (0 <= self.min_tokens, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
        ]
        for value, name in ((self.presence_penalty, "presence"), (self.frequency_penalty, "frequency")):
            checks.append((-2.0 <= value <= 2.0, f"{name}_penalty must be in [-2, 2], got {value}"))
        for top, name in ((self.logprobs, "logprobs"), (self.prompt_logprobs, "prompt_logprobs")):
            in_range = top is None or 0 <= top <= MAX_TOP_LOGPROBS
            checks.append((in_range, f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (top tokens), got {top}"))
        for is_valid, message in checks:
            if not is_valid:
                raise KvqError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
