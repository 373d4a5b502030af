"""Per-item results -> the metric records of a `kvq eval` report, each with its 95% interval.

A record: `key`, `name`, `unit` ("fraction", "perplexity" or "nats"), `model`, `model_ci95`, and, with a
baseline measured on the same items, `baseline`, `delta` (model - baseline) and `ci95`, the paired
interval of the delta. KL and top-1 agreement compare the two models already: their `ci95` is that of
the model's value. Windows of text are the units of the text metrics' intervals (tokens within a window
are not independent). Pure functions; imports kvq.eval.intervals only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvq.eval.intervals import mean_interval, paired_interval, wilson


def accuracy(key: str, name: str, correct: Sequence[bool], baseline_correct: Sequence[bool] | None) -> dict:
    """Accuracy with its Wilson interval; with a baseline on the same items, the paired delta."""
    n = len(correct)
    record = {
        "key": key,
        "name": name,
        "unit": "fraction",
        "num_items": n,
        "model": sum(correct) / n,
        "model_ci95": list(wilson(sum(correct), n)),
    }
    if baseline_correct is not None:
        delta, low, high = paired_interval([float(c) for c in baseline_correct], [float(c) for c in correct])
        record |= {"baseline": sum(baseline_correct) / n, "delta": delta, "ci95": [low, high]}
    return record


def perplexity(nll: Sequence[float], baseline_nll: Sequence[float] | None, num_predicted: int) -> dict:
    """exp(mean NLL per token) over equal-length windows. The model's interval is exp of the interval of
    its per-window mean NLL; the delta's is the paired interval of the per-window NLL differences,
    mapped to perplexity at the baseline's mean NLL."""
    per_token = [v / num_predicted for v in nll]
    mean, low, high = mean_interval(per_token)
    model_ppl = math.exp(mean)
    record: dict = {
        "key": "perplexity",
        "name": "perplexity",
        "unit": "perplexity",
        "num_items": len(nll),
        "model": model_ppl,
        "model_ci95": [math.exp(low), math.exp(high)],
    }
    if baseline_nll is not None:
        base = [v / num_predicted for v in baseline_nll]
        base_ppl = math.exp(math.fsum(base) / len(base))
        _delta, d_low, d_high = paired_interval(base, per_token)
        record |= {
            "baseline": base_ppl,
            "delta": model_ppl - base_ppl,
            "ci95": [base_ppl * math.expm1(d_low), base_ppl * math.expm1(d_high)],
        }
    return record


def kl_divergence(kl: Sequence[float], num_predicted: int) -> dict:
    """Mean KL(baseline ‖ model) of the next-token distributions, nats per token."""
    return _mean_metric("kl", "KL(baseline ‖ model)", "nats", [v / num_predicted for v in kl])


def top1_agreement(num_agree: Sequence[int], num_predicted: int) -> dict:
    """Fraction of positions where both models' most likely next token is the same (interval clipped
    to [0, 1])."""
    per_position = [a / num_predicted for a in num_agree]
    return _mean_metric("top1_agreement", "top-1 agreement", "fraction", per_position)


def _mean_metric(key: str, name: str, unit: str, per_item: list[float]) -> dict:
    """The mean of `per_item` with its interval (a fraction's clipped to [0, 1]), as the model's value."""
    mean, low, high = mean_interval(per_item)
    if unit == "fraction":
        low, high = max(0.0, low), min(1.0, high)
    return {
        "key": key,
        "name": name,
        "unit": unit,
        "num_items": len(per_item),
        "model": mean,
        "model_ci95": [low, high],
        "ci95": [low, high],
    }
