"""Sampler: greedy, temperature, top-k, top-p, seeds, non-finite rows; parameter validation."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.sampling import SamplingParams, filter_logits, make_generator, sample


def logits_rows(num_rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    """On fp32 logits and on bf16 ones as the fast path's lm_head gives them (no fp32 copy)."""
    logits = logits_rows().to(dtype)
    params = [SamplingParams()] * 3
    tokens, errors = sample(logits, params, [None] * 3)
    assert tokens == logits.argmax(-1).tolist() and errors == [None] * 3


def test_top_k_one_and_a_tiny_top_p_are_greedy() -> None:
    logits = logits_rows()
    for params in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)):
        tokens, _ = sample(logits, [params] * 3, [make_generator(params)] * 3)
        assert tokens == logits.argmax(-1).tolist()


def test_filter_keeps_the_top_k_and_the_nucleus() -> None:
    row = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert torch.isfinite(filter_logits(row, 2, 1.0)).tolist() == [False, True, False, True]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # 0.5 < 0.7 so the 0.3 token is needed too; 0.8 >= 0.7 so nothing after it
    assert torch.isfinite(filter_logits(probs, 0, 0.7)).tolist() == [True, True, False, False]


def test_a_seed_fixes_the_draws_whatever_the_batch() -> None:
    logits = logits_rows(num_rows=4)
    params = SamplingParams(temperature=1.5, seed=7)
    alone, _ = sample(logits[2:3], [params], [make_generator(params)])
    others = SamplingParams(temperature=1.0)
    batched, _ = sample(logits, [others, others, params, others], [None, None, make_generator(params), None])
    assert batched[2] == alone[0]


def test_temperature_samples_follow_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    params = SamplingParams(temperature=1.0, seed=0)
    gen = make_generator(params)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [params], [gen])[0][0]] += 1
    assert torch.allclose(counts / 3000, logits.softmax(-1)[0], atol=0.03)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_rows_are_flagged(dtype: torch.dtype) -> None:
    """A NaN or +-inf stops a row; huge finite logits (their sum overflows) are sampled."""
    logits = logits_rows(num_rows=4)
    logits[1, 4] = float("nan")
    logits[2, 0] = float("-inf")
    logits[3] = 3e38
    logits[3, 7] = 3.3e38
    tokens, errors = sample(logits.to(dtype), [SamplingParams(temperature=1.0, seed=0)] * 4, [None] * 4)
    assert errors == [None, "non-finite logits", "non-finite logits", None] and tokens[3] == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": [""]}, "stop strings"),
    ],
)
def test_bad_parameters_are_user_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(KvqError, match=message):
        SamplingParams(**kwargs)
