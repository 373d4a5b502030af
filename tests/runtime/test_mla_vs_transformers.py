"""The MLA models (glm_moe_dsa, deepseek_v3 / Kimi K2) against transformers' fp32 forward of the same
checkpoint, on every MLA fixture: BF16; kvq-compressed `w4a16-experts` from BF16 and from FP8-block (INT4
experts, FP8-block attention); Kimi K2.6's native INT4 layout (nested kimi_k25 config, group 32).

Reference mode (fp32 activations and latent pages) reproduces transformers' greedy tokens exactly, on
prompts longer than `index_topk` too (GLM-5's DSA selects), with prefix sharing and forced preemption;
the DSA selection itself is transformers', query by query. The pool's bytes per token are the plan's.
The fast path: test_mla_fast_path.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvq.checkpoint.kv_cache_spec import kv_cache_bytes
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kv_layout import layout_for
from kvq.runtime.kv_pool import page_bytes
from tests.runtime.dsa_steps import as_choices, teacher_forced_selections, transformers_choices
from tests.runtime.reference import engine_greedy, hf_greedy, hf_reference
from tests.runtime.test_models_vs_transformers import random_prompts

FIXTURES = [("glm_moe_dsa", fmt) for fmt in ("bf16", "int4-from-bf16", "int4-from-fp8-block")]
FIXTURES += [("deepseek_v3", fmt) for fmt in ("bf16", "int4-from-bf16", "int4-from-fp8-block", "kimi-int4")]
IDS = [f"{arch}-{fmt}" for arch, fmt in FIXTURES]
NUM_TOKENS = 32
INDEX_TOPK = 8  # the tiny glm_moe_dsa's


def shared_prefix_prompts() -> list[list[int]]:
    """Two prompts sharing five full pages of 4 tokens, one short and one long (> index_topk) alone."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 2000, (22,), generator=gen).tolist()
    shared = [prefix + torch.randint(3, 2000, (3 + i,), generator=gen).tolist() for i in range(2)]
    return [*shared, *random_prompts((5, 37), seed=3)]


@pytest.fixture
def checkpoint(mla_checkpoint, request: pytest.FixtureRequest) -> Path:
    return mla_checkpoint(*request.param)


def engine_with_pages(path: Path, num_pages: int, **kwargs) -> Engine:
    """A reference-mode engine (pages of 4 tokens) whose pool holds exactly `num_pages` pages."""
    probe = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="1MiB", page_size=4))
    is_checked = kwargs.get("kv_integrity", "off") != "off"  # a checked pool's pages hold slot stamps too
    size = page_bytes(probe.kv_pool.layout, probe.kv_pool.num_layers, 4, is_checked)
    config = EngineConfig(model=str(path), dtype="float32", kv_memory=num_pages * size, page_size=4, **kwargs)
    return Engine(config)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", FIXTURES, indirect=True, ids=IDS)
def test_reference_mode_greedy_matches_transformers(checkpoint: Path) -> None:
    prompts = shared_prefix_prompts()
    assert max(len(p) for p in prompts) > INDEX_TOPK
    hf = hf_reference(checkpoint)
    expected = [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]
    roomy = Engine(
        EngineConfig(model=str(checkpoint), dtype="float32", kv_memory="16MiB", enable_prefix_caching=False)
    )
    assert engine_greedy(roomy, prompts, NUM_TOKENS) == expected
    # 24 pages of 4 tokens for four requests of up to 69 tokens (18 pages): admitted on prompt pages alone,
    # they run out of pages in decode and are preempted and recomputed, sharing the prefix pages
    tight = engine_with_pages(checkpoint, 24, decode_reserve_ratio=0.0)
    assert engine_greedy(tight, prompts, NUM_TOKENS) == expected
    assert tight.scheduler.num_preemptions > 0 and tight.block_manager.num_prefix_hits >= 5
    assert tight.block_manager.num_free_pages == 24  # every page came back


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int4-from-fp8-block"])
def test_dsa_selection_is_transformers(mla_checkpoint, fmt: str) -> None:
    """Per layer and query, kvq's indexer selects the tokens transformers' selects: a prompt of 37 tokens
    (index_topk 8: every query past the 8th chooses), then decode steps."""
    path = mla_checkpoint("glm_moe_dsa", fmt)
    hf = hf_reference(path)
    prompt = random_prompts((37,), seed=4)[0]
    continuation = hf_greedy(hf, prompt, 6)
    expected = transformers_choices(hf, prompt, 6)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    found = as_choices(teacher_forced_selections(engine, prompt, continuation), len(prompt))
    assert [len(rows) for rows in found] == [len(prompt) + 6] * 3
    assert all(len(chosen) == min(INDEX_TOPK, at + 1) for rows in found for at, chosen in enumerate(rows))
    assert found == expected


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_fp8_latent_pool_holds_twice_the_tokens_and_plans_bytes(mla_checkpoint, arch: str) -> None:
    """Bytes per token of the pool are `kv_cache_bytes`' (`kvq_total`, kvq's own pool in `kvq plan`) in each
    mode. FP8 latent rows are half the BF16 ones: with --kv-integrity off (no stamp) the pool holds twice
    the tokens; a checked pool holds a stamp of 8 bytes per slot and layer beside each row, so its ratio is
    (bf16 row + 8) / (fp8 row + 8): 1.96x on this tiny model's 192-wide rows, 1.986x on GLM-5's 576
    (GLM-5's index keys stay bf16 in both)."""
    path = mla_checkpoint(arch, "bf16")
    tokens, rows = {}, {}
    for mode in ("off", "tags"):
        is_checked = mode != "off"
        for kv_cache_dtype in ("bf16", "fp8_e4m3"):
            config = EngineConfig(
                model=str(path), kv_cache_dtype=kv_cache_dtype, kv_memory="8MiB", kv_integrity=mode
            )
            engine = Engine(config)
            pool, spec = engine.kv_pool, engine.kv_spec
            per_token = kv_cache_bytes(spec, kv_cache_dtype).kvq_total(is_checked)
            assert (
                page_bytes(pool.layout, pool.num_layers, pool.page_size, is_checked)
                == pool.page_size * per_token
            )
            assert pool.nbytes == (pool.num_pages + 1) * pool.page_size * per_token, (mode, kv_cache_dtype)
            tokens[mode, kv_cache_dtype] = pool.num_tokens
            latent_layout = layout_for(replace(spec, index_head_dim=0), pool.dtype)
            rows[kv_cache_dtype] = page_bytes(latent_layout, pool.num_layers, 1) // pool.num_layers
            latent_bytes = page_bytes(latent_layout, pool.num_layers, 1, is_checked)
            tokens[mode, f"{kv_cache_dtype} latent"] = (8 << 20) // latent_bytes
    assert rows["bf16"] == 2 * rows["fp8_e4m3"]  # the latent row itself: half the bytes
    ratios = {"off": 2.0, "tags": (rows["bf16"] + 8) / (rows["fp8_e4m3"] + 8)}
    for mode, ratio in ratios.items():
        assert tokens[mode, "fp8_e4m3 latent"] / tokens[mode, "bf16 latent"] == pytest.approx(ratio, rel=1e-3)
        if arch == "deepseek_v3":  # no indexer: the pool is all latent
            assert tokens[mode, "fp8_e4m3"] / tokens[mode, "bf16"] == pytest.approx(ratio, rel=1e-2), mode
