"""Teacher-forced scoring: the engine decodes given tokens instead of sampled ones and sums their NLL.

`score_continuations(engine, requests)` is the log-likelihood of each (prompt, continuation) pair, every
token predicted by the engine's own prefill and decode steps (FP8 pages included), as serving does; all
requests are queued at once, so pairs that share a prompt share its KV pages (the runtime's prefix cache)
and run in the same batches. `perplexity(engine, windows)` is its special case for token windows.
`TeacherForcing` is the engine token hook that does it; `force(...)` queues one forced request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvq.errors import KvqError
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from kvq.runtime.engine import Engine

Pair = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, continuation token ids)


def perplexity(engine: Engine, windows: Sequence[Sequence[int]]) -> float:
    """exp(mean next-token NLL) of token windows, every prediction made by a decode step that reads
    the earlier tokens' K/V from the paged pool (FP8 pages included), as serving does: each window is
    a one-token prompt whose completion is forced to the window's next tokens (teacher forcing)."""
    if not windows or any(len(w) < 2 for w in windows):
        raise KvqError("perplexity needs windows of at least 2 tokens")
    nll = score_continuations(engine, [([w[0]], w[1:]) for w in windows])
    return math.exp(sum(nll) / sum(len(w) - 1 for w in windows))


def score_continuations(
    engine: Engine, requests: Sequence[Pair], on_finished: Callable[[int], None] | None = None
) -> list[float]:
    """-log p(continuation | prompt) summed over the continuation's tokens, per request, in order.

    All requests are queued together (admission by free pages), so requests with a common prompt
    prefix share its pages and the batch's prefill; `on_finished(n)` is told of each n finished.
    """
    if any(not c for _p, c in requests):
        raise KvqError("every scored continuation needs at least one token")
    forcing = TeacherForcing()
    seqs = [force(engine, forcing, prompt, continuation) for prompt, continuation in requests]
    run_forced(engine, forcing, seqs, on_finished)
    return [forcing.nll[s.seq_id] for s in seqs]


def force(
    engine: Engine, forcing: TeacherForcing, prompt: Sequence[int], continuation: Sequence[int]
) -> Request:
    """Queue one request whose completion is forced to `continuation` (validated by the engine)."""
    params = SamplingParams(max_tokens=len(continuation), ignore_eos=True)
    seq = engine.make_sequence(list(prompt), params)
    forcing.forced[seq.seq_id] = list(continuation)
    engine.scheduler.add(seq)  # no text: scored tokens are not read
    return seq


def run_forced(
    engine: Engine,
    forcing: TeacherForcing,
    seqs: list[Request],
    on_finished: Callable[[int], None] | None = None,
) -> None:
    """Step `engine` with `forcing` as a token hook until every one of `seqs` has finished."""
    engine.token_hooks.append(forcing)
    try:
        while any(s.finish_reason is None for s in seqs):
            num_done = sum(out.finished for out in engine.step())
            if num_done and on_finished is not None:
                on_finished(num_done)
    finally:
        engine.token_hooks.remove(forcing)
    check_finished(seqs)


def check_finished(seqs: list[Request]) -> None:
    """`KvqError` unless every forced request ran to its last given token."""
    if any(s.finish_reason != "length" for s in seqs):
        errors = sorted({f"{s.finish_reason}: {s.error}" for s in seqs if s.finish_reason != "length"})
        raise KvqError(f"a scored request stopped early ({'; '.join(errors)})")


class TeacherForcing:
    """An engine token hook: forced requests take their next given token (not the sampled one) and add
    its negative log-likelihood under the step's logits. State by request id."""

    def __init__(self) -> None:
        self.forced: dict[int, list[int]] = {}  # request id -> the completion to append
        self.nll: dict[int, float] = {}  # request id -> sum of -log p(forced token) so far

    def __call__(self, seqs: list[Request], logits: torch.Tensor, token_ids: list[int]) -> None:
        rows = [i for i, s in enumerate(seqs) if s.seq_id in self.forced]
        if not rows:
            return
        log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
        for row, log_prob in zip(rows, log_probs, strict=True):
            seq = seqs[row]
            token_ids[row] = self.forced[seq.seq_id][seq.num_tokens - seq.num_prompt_tokens]
            self.nll[seq.seq_id] = self.nll.get(seq.seq_id, 0.0) - float(log_prob[token_ids[row]])
