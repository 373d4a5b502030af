"""95% intervals against scipy's: Wilson score intervals and normal intervals of means and paired deltas."""

from __future__ import annotations

import math
import random

import pytest
from scipy import stats

from kvq.eval.intervals import mean_interval, paired_interval, wilson


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (137, 500), (1, 2)])
def test_wilson_equals_scipy(k, n) -> None:
    expected = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson(k, n) == pytest.approx((expected.low, expected.high), abs=1e-12)


def test_mean_interval_is_the_normal_interval_of_the_mean() -> None:
    rng = random.Random(0)
    values = [rng.gauss(2.0, 0.7) for _ in range(50)]
    mean, low, high = mean_interval(values)
    expected = stats.norm.interval(0.95, loc=sum(values) / 50, scale=stats.sem(values))
    assert (low, high) == pytest.approx(expected, rel=1e-12)
    assert mean == pytest.approx(sum(values) / 50)


def test_paired_interval_uses_the_differences() -> None:
    rng = random.Random(1)
    baseline = [float(rng.random() < 0.6) for _ in range(400)]
    model = [b if rng.random() < 0.9 else 1 - b for b in baseline]  # flips 10% of answers
    delta, low, high = paired_interval(baseline, model)
    diffs = [m - b for b, m in zip(baseline, model, strict=True)]
    assert delta == pytest.approx(sum(diffs) / 400)
    assert high - low == pytest.approx(2 * 1.959963984540054 * stats.sem(diffs))
    unpaired_half = 1.96 * math.sqrt(2 * 0.6 * 0.4 / 400)
    assert (high - low) / 2 < unpaired_half  # agreeing models: tighter than two independent samples


def test_degenerate_inputs() -> None:
    assert all(math.isnan(v) for v in wilson(0, 0))
    assert mean_interval([1.5])[0] == 1.5 and math.isnan(mean_interval([1.5])[1])
    assert paired_interval([1.0, 0.0], [1.0, 0.0]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="same items"):
        paired_interval([1.0], [1.0, 0.0])
