"""Text metrics from a server's top-N prompt log-probabilities: the KL is a lower bound of the full KL,
equal to it when every token comes back; agreement compares the rank-1 tokens."""

from __future__ import annotations

import math

import pytest
import torch

from kvq.eval.server_text import kl_lower_bound, top1


def top_n(log_probs: torch.Tensor, n: int, extra: int) -> dict[int, float]:
    """What a server returns for one position: its top n and the prompt's own token `extra`."""
    ids = log_probs.topk(n).indices.tolist() + [extra]
    return {i: float(log_probs[i]) for i in ids}


@pytest.mark.parametrize("seed", range(5))
def test_kl_from_top_n_is_a_lower_bound_that_tightens(seed: int) -> None:
    torch.manual_seed(seed)
    base = torch.log_softmax(torch.randn(301, dtype=torch.float64) * 3, dim=-1)
    model = torch.log_softmax(base + 0.3 * torch.randn(301, dtype=torch.float64), dim=-1)
    exact = float((base.exp() * (base - model)).sum())
    bounds = [kl_lower_bound(top_n(base, n, 7), top_n(model, n, 7)) for n in (1, 5, 20, 301)]
    assert all(b <= exact + 1e-12 for b in bounds)
    assert bounds == sorted(bounds)  # a finer partition never loses KL
    assert bounds[-1] == pytest.approx(exact, rel=1e-9)  # every token back: the KL itself
    assert bounds[2] >= 0.5 * exact


def test_identical_distributions_have_no_kl_and_agree() -> None:
    position = {3: math.log(0.5), 9: math.log(0.3), 4: math.log(0.1)}
    assert kl_lower_bound(position, dict(position)) == pytest.approx(0.0, abs=1e-15)
    assert top1(position) == 3 and top1({5: -1.0, 2: -1.0}) == 2
