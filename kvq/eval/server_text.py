"""Held-out text through two servers: each window's NLL from its prompt log-probabilities, and KL(baseline ‖
model) and top-1 agreement from the top-N of each position (vLLM's `prompt_logprobs: N`, keyed by id).

With only the top N back, KL is computed on a coarser distribution: the tokens both servers returned
(each side's top N and the window's own token), plus one bucket holding the rest of each side's mass.
KL of a coarse-graining never exceeds the KL of the full distributions (data-processing inequality), so
the value is a lower bound that tightens as N grows; the report says so and names N. Top-1 agreement is
exact for any N >= 1 (each side's rank-1 token is returned). Imports the standard library and kvq.eval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvq.eval.server_client import Server
from kvq.eval.text import WindowScores

TopLogprobs = dict[int, float]  # token id -> log-probability, one position


def served_window_scores(
    model: Server,
    baseline: Server | None,
    windows: Sequence[Sequence[int]],
    top_n: int,
    num_concurrent: int = 4,
    advance: Callable[[int], None] | None = None,
) -> WindowScores:
    """Per window: the model's (and the baseline's) summed NLL; with a baseline, the summed KL lower bound
    and the number of positions whose top-1 tokens agree."""

    def one(window: Sequence[int]) -> tuple[list[TopLogprobs], list[TopLogprobs] | None]:
        mine = prompt_logprobs(model, window, top_n)
        theirs = None if baseline is None else prompt_logprobs(baseline, window, top_n)
        if advance is not None:
            advance(1)
        return mine, theirs

    with ThreadPoolExecutor(max_workers=max(1, num_concurrent)) as pool:
        answers = list(pool.map(one, windows))
    scores = WindowScores(num_predicted=len(windows[0]) - 1, nll=[])
    for window, (mine, theirs) in zip(windows, answers, strict=True):
        targets = list(window[1:])
        scores.nll.append(-math.fsum(pos[t] for pos, t in zip(mine, targets, strict=True)))
        if theirs is not None:
            scores.reference_nll.append(-math.fsum(pos[t] for pos, t in zip(theirs, targets, strict=True)))
            scores.kl.append(math.fsum(kl_lower_bound(b, m) for b, m in zip(theirs, mine, strict=True)))
            scores.num_agree.append(sum(top1(b) == top1(m) for b, m in zip(theirs, mine, strict=True)))
    return scores


def prompt_logprobs(server: Server, window: Sequence[int], top_n: int) -> list[TopLogprobs]:
    """Per predicted position of the window (tokens 1..L-1): the returned log-probabilities by id."""
    body = {"model": server.model, "prompt": list(window), "max_tokens": 1, "temperature": 0.0}
    body |= {"prompt_logprobs": top_n}
    entries = server.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
    if len(entries) != len(window) or entries[0] is not None:
        raise ValueError(
            f"{server.url}: {len(entries)} prompt_logprobs entries for a {len(window)}-token prompt"
        )
    return [{int(k): float(v["logprob"]) for k, v in entry.items()} for entry in entries[1:]]


def kl_lower_bound(baseline: TopLogprobs, model: TopLogprobs) -> float:
    """KL(baseline ‖ model) over the tokens both returned plus one bucket for the rest (<= the true KL)."""
    shared = baseline.keys() & model.keys()
    kl = math.fsum(math.exp(baseline[t]) * (baseline[t] - model[t]) for t in shared)
    p_rest = 1.0 - math.fsum(math.exp(baseline[t]) for t in shared)
    q_rest = 1.0 - math.fsum(math.exp(model[t]) for t in shared)
    if p_rest > 1e-9 and q_rest > 1e-12:
        kl += p_rest * math.log(p_rest / q_rest)
    return kl


def top1(position: TopLogprobs) -> int:
    """The most likely returned token (ties: the smaller id, a stable choice)."""
    return max(position, key=lambda t: (position[t], -t))
