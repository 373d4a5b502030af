"""95% intervals: Wilson score intervals for accuracies, normal intervals for means and for paired deltas.

A delta between two models measured on the same items is summarized by the per-item differences, whose
spread is much smaller than either model's own when the models agree on most items (Miller 2024,
"Adding Error Bars to Evals", section 4). Pure functions over Python numbers; imports only `math`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(num_correct: int, num_items: int) -> tuple[float, float]:
    """Wilson score interval of a proportion (stays inside [0, 1], fine at 0 and n correct)."""
    if num_items == 0:
        return (math.nan, math.nan)
    p, n, z2 = num_correct / num_items, num_items, Z95 * Z95
    center = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (max(0.0, center - half), min(1.0, center + half))


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the normal interval mean +- z * s / sqrt(n), s the sample standard deviation."""
    n = len(values)
    if n == 0:
        return (math.nan, math.nan, math.nan)
    mean = math.fsum(values) / n
    if n == 1:
        return (mean, math.nan, math.nan)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return (mean, mean - half, mean + half)


def paired_interval(baseline: Sequence[float], model: Sequence[float]) -> tuple[float, float, float]:
    """(mean of model - baseline, low, high) over the same items, from the per-item differences."""
    if len(baseline) != len(model):
        raise ValueError(f"paired values need the same items: {len(baseline)} vs {len(model)}")
    return mean_interval([m - b for b, m in zip(baseline, model, strict=True)])
