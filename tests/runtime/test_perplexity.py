"""`scoring.perplexity` (teacher-forced decode steps over the paged KV pool) equals transformers' forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvq.calibrate.samples import build_samples
from kvq.data.texts import load_texts
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.scoring import perplexity


def transformers_perplexity(path, input_ids: torch.Tensor) -> float:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1)
    )
    return math.exp(float(nll))


@pytest.fixture(scope="module")
def windows_and_expected(smollm2) -> tuple[list[list[int]], float]:
    """Four held-out windows of 64 tokens and transformers' perplexity of them (one model load for both
    pool sizes)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2.bf16)
    texts = load_texts(None, "held_out")
    windows = build_samples(texts, tokenizer, num_samples=4, seq_len=64, seed=0, source="held out")
    return windows.input_ids.tolist(), transformers_perplexity(smollm2.bf16, windows.input_ids)


@pytest.mark.parametrize("kv_memory", ["64MiB", "5MiB"], ids=["all-at-once", "a-few-at-a-time"])
def test_equals_transformers_in_fp32(smollm2, windows_and_expected, kv_memory) -> None:
    engine = Engine(EngineConfig(model=str(smollm2.bf16), dtype="float32", kv_memory=kv_memory, threads=2))
    windows, expected = windows_and_expected
    assert perplexity(engine, windows) == pytest.approx(expected, rel=1e-5)
    if kv_memory == "5MiB":  # 6 pages of fp32 K/V: not the 16 of 4 windows at once
        assert engine.stats.largest_batch < 4
    else:
        assert engine.stats.largest_batch == 4
    assert not engine.has_unfinished_requests()


def test_windows_need_two_tokens(smollm2) -> None:
    engine = Engine(EngineConfig(model=str(smollm2.bf16), kv_memory="8MiB"))
    with pytest.raises(KvqError, match="at least 2 tokens"):
        perplexity(engine, [[1, 2, 3], [4]])
