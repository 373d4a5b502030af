"""Multiple choice by log-likelihood, as lm-evaluation-harness's `multiple_choice` tasks score it.

Each choice is a (context, continuation) request; its log-likelihood is the sum of the continuation
tokens' log-probabilities, computed by the kvq engine with teacher forcing
(`kvq.runtime.scoring.score_continuations`). The choices of a question are queued together, so their
common context is prefilled once and its KV pages are shared (the runtime's prefix cache); the prediction
is the most likely choice (lm-eval's `acc`: argmax, first on ties). Imports kvq.runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvq.runtime.scoring import score_continuations

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's `HFLM._encode_pair`: trailing spaces of the context move to the continuation, the
    continuation's tokens are those of context + continuation after the context's (no special tokens, as
    lm-eval's HF backend encodes for a causal model without add_bos_token)."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


def fit(context_ids: list[int], continuation_ids: list[int], max_len: int) -> list[int]:
    """The context cut from the left so context + continuation fit `max_len` tokens (lm-eval keeps the
    last max_length + 1 tokens of the request the same way)."""
    excess = len(context_ids) + len(continuation_ids) - max_len
    return context_ids[excess:] if excess > 0 else context_ids


def choice_log_likelihoods(
    engine: Engine,
    questions: Sequence[tuple[str, Sequence[str]]],
    on_finished: Callable[[int], None] | None = None,
) -> list[list[float]]:
    """For each (context, choices) question, the log-likelihood of every choice, in order."""
    requests = []
    for context, choices in questions:
        for choice in choices:
            context_ids, continuation_ids = encode_pair(engine.tokenizer, context, choice)
            requests.append((fit(context_ids, continuation_ids, engine.max_model_len), continuation_ids))
    nll = score_continuations(engine, requests, on_finished)
    out, start = [], 0
    for _context, choices in questions:
        out.append([-v for v in nll[start : start + len(choices)]])
        start += len(choices)
    return out


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first one on ties (numpy.argmax, as lm-eval uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))
