"""Which drafted tokens a request keeps: the acceptance rule of speculative decoding, one request at a time.

Greedy: the drafts up to the first that differs from the model's own argmax, then the model's token there
(or, all accepted, the bonus token after the last). Sampling (Leviathan et al., Chen et al.: the output
is distributed as the model's alone): draft x ~ q is kept with probability min(1, p(x) / q(x)); at the first
rejection the token is drawn from norm(max(0, p - q)); all kept, a bonus token from the last row's p.
p is the request's own distribution of each row (its temperature, top-k, top-p, min-p, and its logit
bias and penalties over the tokens accepted before that row), drawn with its own generator.
Imports torch and kvq.runtime.sampling.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvq.runtime.request import Request
from kvq.runtime.sampling import filter_logits, filter_min_p, needs_processing, process_row, sample
from kvq.runtime.sampling_params import SamplingParams


@dataclass
class Verdict:
    """A request's outcome of one verified step: the tokens it emits (accepted drafts, then the model's
    own), how many of them were drafts, and the error that ends it (its logits could not be sampled)."""

    token_ids: list[int]
    num_accepted: int
    error: str | None = None


def probs_of(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row `[V]` -> the request's sampling distribution (fp32, sums to 1)."""
    filtered = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = filter_min_p(filtered.softmax(-1), params.min_p)
    return probs / probs.sum()


def draft_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft from the MTP layer's row `[V]`: its argmax for a greedy request, else drawn from q (returned
    with q, which the acceptance test divides by)."""
    if params.is_greedy:
        return int(logits.float().argmax()), None
    q = probs_of(logits, params)
    return int(torch.multinomial(q, 1, generator=generator)), q


def accept(
    seq: Request,
    rows: torch.Tensor,
    drafts: list[int],
    draft_probs: list[torch.Tensor | None],
    eos_token_ids: Collection[int],
) -> Verdict:
    """`rows` `[k + 1, V]`: the model's logits after `seq`'s last token and after each of its `k` drafts."""
    params, generator = seq.params, seq.generator
    emitted: list[int] = []
    for j in range(len(drafts) + 1):
        row = rows[j]
        if needs_processing(params):
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            row = process_row(row, params, prompt, seq.completion_token_ids + emitted, eos_token_ids)
        if params.is_greedy or j == len(drafts):
            tokens, errors = sample(row[None], [params], [generator])
            if errors[0] is not None:
                return Verdict(emitted, len(emitted), errors[0])
            emitted.append(tokens[0])
            if j == len(drafts) or tokens[0] != drafts[j]:
                return Verdict(emitted, j)
            continue
        p = probs_of(row, params)
        if not bool(torch.isfinite(p).all()):
            return Verdict(emitted, len(emitted), "non-finite logits")
        x, q = drafts[j], draft_probs[j]
        assert q is not None, "a sampled draft carries its distribution"
        if float(torch.rand((), generator=generator)) * float(q[x]) <= float(p[x]) and float(p[x]) > 0:
            emitted.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        residual = residual if float(residual.sum()) > 0 else p
        emitted.append(int(torch.multinomial(residual, 1, generator=generator)))
        return Verdict(emitted, j)
    raise AssertionError("the loop returns at its last row")
