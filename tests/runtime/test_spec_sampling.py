"""`--speculative mtp` with sampling: the first three tokens of many seeded completions (temperature 1,
top-k 3, K = 1: a draft and a bonus token or a residual draw) follow the joint distribution of decoding
without speculation, computed exactly from the plain engine's own logits (teacher-forced along every
prefix), by a chi-square goodness-of-fit test; plain sampling passes the same test (the oracle is the
sampler's distribution), and the test rejects a wrong acceptance rule (a rejected draft replaced by a draw
from p instead of from norm(max(0, p - q))), so it has the power to see one.

The MTP layer is fitted (`kvq.fixtures.mtp_fit`) so that drafts are often accepted: with a random one
nearly every draft is rejected and a wrong rule at acceptance would go unseen. Every draw is seeded, so
the test is deterministic; the thresholds (p > 1e-3 for the right rule, < 1e-6 for the wrong one) leave
room for any change of the model's numerics that keeps the rule right.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from kvq.runtime import spec_step
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.spec_accept import Verdict, probs_of
from tests.runtime.reference import teacher_forced_logits

NUM_DRAWS = 800
NUM_TOKENS = 3
PROMPT = [1, 5, 9, 200, 33, 7]
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_k=3, ignore_eos=True)


def drawn(engine: Engine) -> Counter[tuple[int, ...]]:
    """How often each sequence of the first NUM_TOKENS tokens comes out, over NUM_DRAWS seeds."""
    params = [replace(PARAMS, seed=s) for s in range(NUM_DRAWS)]
    return Counter(tuple(out.token_ids) for out in engine.generate([PROMPT] * NUM_DRAWS, params))


def exact(engine: Engine) -> dict[tuple[int, ...], float]:
    """The probability of every sequence of NUM_TOKENS tokens under PARAMS, from `engine`'s logits."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NUM_TOKENS):
        longer = {}
        for prefix, prob in probs.items():
            p = probs_of(teacher_forced_logits(engine, PROMPT, list(prefix))[-1], PARAMS)
            longer |= {(*prefix, int(t)): prob * float(p[t]) for t in p.nonzero()[:, 0]}
        probs = longer
    return probs


def fit_p(counts: Counter, probs: dict[tuple[int, ...], float], min_expected: float = 5.0) -> float:
    """The chi-square p-value of `counts` under `probs`; sequences expected fewer than `min_expected` times
    are pooled into one cell (the test's approximation needs counts)."""
    assert set(counts) <= set(probs), set(counts) - set(probs)
    kept = [x for x in probs if probs[x] * NUM_DRAWS >= min_expected]
    observed = [counts[x] for x in kept] + [NUM_DRAWS - sum(counts[x] for x in kept)]
    expected = [probs[x] * NUM_DRAWS for x in kept] + [NUM_DRAWS * (1 - sum(probs[x] for x in kept))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    scale = sum(observed) / sum(expected)  # float rounding of the probabilities' sum
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


def accept_resampling_from_p(
    seq: Request, rows: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor | None], *_: object
) -> Verdict:
    """A wrong rule (the negative control): drafts are kept with probability min(1, p / q) as they should,
    but a rejected one is replaced by a draw from p, which over-weights the tokens the drafts favour."""
    params, generator = seq.params, seq.generator
    emitted: list[int] = []
    for j, x in enumerate(drafts):
        p, q = probs_of(rows[j], params), draft_probs[j]
        assert q is not None
        if float(torch.rand((), generator=generator)) * float(q[x]) <= float(p[x]):
            emitted.append(x)
            continue
        emitted.append(int(torch.multinomial(p, 1, generator=generator)))
        return Verdict(emitted, j)
    emitted.append(int(torch.multinomial(probs_of(rows[-1], params), 1, generator=generator)))
    return Verdict(emitted, len(drafts))


@pytest.fixture(scope="module")
def fitted_mtp(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvq.fixtures.mtp_fit import build_predictive_mtp

    source = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    return build_predictive_mtp(source, tmp_path_factory.mktemp("fit") / "model", [PROMPT], 8, steps=150)


def engine_of(path: Path, speculative: str | None = None) -> Engine:
    config = EngineConfig(
        model=str(path), dtype="float32", kv_memory="64MiB", max_num_seqs=NUM_DRAWS, speculative=speculative
    )
    return Engine(config)


@pytest.mark.slow
def test_sampled_tokens_are_distributed_as_without_speculation(
    fitted_mtp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = engine_of(fitted_mtp)
    probs = exact(plain)
    assert abs(sum(probs.values()) - 1.0) < 1e-4 and len(probs) == 3**NUM_TOKENS
    assert fit_p(drawn(plain), probs) > 1e-3  # the oracle is plain sampling's distribution

    spec = engine_of(fitted_mtp, "mtp")
    right = drawn(spec)
    stats = spec.proposer.stats  # type: ignore[union-attr]
    assert stats.num_drafts >= NUM_DRAWS and stats.acceptance_rate > 0.2, stats  # the rule is exercised
    assert fit_p(right, probs) > 1e-3, sorted(right.items())

    monkeypatch.setattr(spec_step, "accept", accept_resampling_from_p)
    assert fit_p(drawn(engine_of(fitted_mtp, "mtp")), probs) < 1e-6
