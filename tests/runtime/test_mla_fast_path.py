"""The fast path of the MLA models (bf16 activations, INT4 op, BF16 or calibrated FP8 latent pages)
against transformers' fp32 forward, on every MLA fixture, teacher-forced along transformers' greedy
continuation: logit tolerances and top-1 agreement.

A random tiny model has near-tied logits, so a pick whose reference logit ties the best within the
path's tolerance counts as agreeing (as in test_engine_triton), beside the raw agreement. A random tiny
DSA indexer's scores are near-tied too: in bf16 its choice flips wherever rounding moves a score, and
a flipped choice moves the hidden states far (transformers' own bf16 forward of the tiny GLM agrees
only ~70% with its fp32 one). So GLM's fast path is checked in two parts: its arithmetic, with the
reference's selection replayed, to the same bounds as DeepSeek's; and its own selection, which must
be the reference's on >= 90% of the first DSA layer's queries (their inputs differ only by rounding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.checkpoint.model_config import read_text_model
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.runtime.dsa_steps import as_choices, replay, teacher_forced_selections
from tests.runtime.kv_scales import measure_kv_scales, with_kv_scales
from tests.runtime.reference import hf_greedy, hf_reference, hf_stepped_logits, teacher_forced_logits
from tests.runtime.test_mla_vs_transformers import FIXTURES, IDS, NUM_TOKENS
from tests.runtime.test_models_vs_transformers import random_prompts

# (KV dtype, median row error bound, tie): bf16 latent ~0.03 of the logits' std, FP8 latent ~0.14 (an
# e4m3 step per value); a wrong layer or scale: ~1
BOUNDS = {"bf16": (0.06, 0.1), "fp8_e4m3": (0.25, 0.25)}
Case = tuple[list[int], list[int], torch.Tensor]  # prompt, greedy continuation, fp32 logits [33, V]
# (the reference logits are transformers' own steps, a prefill and decode steps, as kvq's teacher forcing)


@pytest.fixture
def checkpoint(mla_checkpoint, request: pytest.FixtureRequest) -> Path:
    return mla_checkpoint(*request.param)


def tie_aware_agreement(found: torch.Tensor, expected: torch.Tensor, tie: float) -> torch.Tensor:
    """Per position: 1 where found's top-1 is expected's, or a token whose expected logit is within
    `tie` logit standard deviations of expected's best (a near-tie of the reference, not an error)."""
    chosen = expected.gather(1, found.argmax(dim=1, keepdim=True))[:, 0]
    return (chosen >= expected.max(dim=1).values - tie * expected.std()).float()


def reference_cases(checkpoint: Path) -> list[Case]:
    hf = hf_reference(checkpoint)
    cases = []
    for prompt in random_prompts((20, 33), seed=2):
        continuation = hf_greedy(hf, prompt, NUM_TOKENS)
        cases.append((prompt, continuation, hf_stepped_logits(hf, prompt, continuation)))
    return cases


def assert_close(logits: list[torch.Tensor], cases: list[Case], kv_cache_dtype: str) -> None:
    median_bound, tie = BOUNDS[kv_cache_dtype]
    errors, raw, tied = [], [], []
    for found, (_, _, expected) in zip(logits, cases, strict=True):
        errors.append((found - expected).abs().amax(-1) / expected.std())
        raw.append((found.argmax(-1) == expected.argmax(-1)).float())
        tied.append(tie_aware_agreement(found, expected, tie))
    error, agreement, tie_aware = (torch.cat(x) for x in (errors, raw, tied))
    numbers = (kv_cache_dtype, error.median().item(), agreement.mean().item(), tie_aware.mean().item())
    assert error.median() < median_bound and tie_aware.mean() >= 0.9 and agreement.mean() >= 0.8, numbers


def check_fast_path(checkpoint: Path, tmp_path: Path, device: str = "cpu") -> None:
    """The fast path on `device`, BF16 and calibrated FP8 latent pages, within BOUNDS of transformers'
    fp32 forward (GLM: along the reference's DSA selection, replayed)."""
    scales = measure_kv_scales(checkpoint, random_prompts((64,) * 4, 1))
    calibrated = with_kv_scales(checkpoint, tmp_path / "model", scales)
    cases = reference_cases(checkpoint)
    is_dsa = read_text_model(checkpoint).model_type == "glm_moe_dsa"
    if is_dsa:  # the reference's selections, step by step (kvq's reference mode selects transformers')
        config = EngineConfig(model=str(checkpoint), dtype="float32", kv_memory="16MiB", device="cpu")
        reference = Engine(config)
        chosen = [teacher_forced_selections(reference, p, c) for p, c, _ in cases]
    for kv_cache_dtype in BOUNDS:
        config = EngineConfig(
            model=str(calibrated),
            kv_cache_dtype=kv_cache_dtype,
            kv_memory="16MiB",
            require_kv_scales=True,
            device=device,
        )
        logits = []
        for i, (prompt, continuation, _) in enumerate(cases):
            engine = Engine(config)
            if is_dsa:
                replay(engine, chosen[i])
            logits.append(teacher_forced_logits(engine, prompt, continuation))
        assert_close(logits, cases, kv_cache_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", FIXTURES, indirect=True, ids=IDS)
def test_fast_path_close_to_the_reference(checkpoint: Path, tmp_path: Path) -> None:
    check_fast_path(checkpoint, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int4-from-fp8-block"])
def test_fast_path_dsa_selection_is_the_references(mla_checkpoint, fmt: str) -> None:
    path = mla_checkpoint("glm_moe_dsa", fmt)
    reference = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    fast = Engine(EngineConfig(model=str(path), kv_cache_dtype="bf16", kv_memory="16MiB"))
    same = []
    for prompt, continuation in zip(
        random_prompts((20, 33), seed=2), random_prompts((8, 8), seed=7), strict=True
    ):
        expected = as_choices(teacher_forced_selections(reference, prompt, continuation), len(prompt))[0]
        found = as_choices(teacher_forced_selections(fast, prompt, continuation), len(prompt))[0]
        same += [a == b for a, b in zip(found, expected, strict=True)]
    assert sum(same) >= 0.9 * len(same), f"{sum(same)} of {len(same)} queries"
