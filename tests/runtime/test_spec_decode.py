"""`--speculative mtp` on the MLA fixtures that carry an MTP layer: fp32 greedy output is the output without
it (BF16; kvq-compressed from BF16 and FP8-block; prefix sharing, forced preemption, --tp 2), no page is
leaked by rolled-back drafts, and a fitted MTP layer (`kvq.fixtures.mtp_fit`) is accepted more often than
not and needs fewer steps of the model per token. Sampling: `test_spec_sampling.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy
from tests.runtime.test_mla_vs_transformers import engine_with_pages, shared_prefix_prompts

NUM_TOKENS = 20


def spec_engine(path: Path, k: int, **kwargs) -> Engine:
    return Engine(
        EngineConfig(model=str(path), dtype="float32", speculative="mtp", num_speculative_tokens=k, **kwargs)
    )


@pytest.fixture(
    params=[
        "glm_moe_dsa-bf16",
        "deepseek_v3-bf16",
        "glm_moe_dsa-int4-from-fp8-block",
        "deepseek_v3-int4-from-bf16",
    ]
)
def mtp_checkpoint(request: pytest.FixtureRequest, tiny_checkpoint, compressed) -> Path:
    arch, fmt = request.param.split("-", 1)
    if fmt == "bf16":
        return tiny_checkpoint(arch, "bf16", num_mtp_layers=1)
    return compressed(arch, fmt.removeprefix("int4-from-"), "w4a16-experts", num_mtp_layers=1)


def test_greedy_is_the_models_own(mtp_checkpoint: Path) -> None:
    prompts = shared_prefix_prompts()
    plain = Engine(EngineConfig(model=str(mtp_checkpoint), dtype="float32", kv_memory="16MiB"))
    expected = engine_greedy(plain, prompts, NUM_TOKENS)
    for k in (1, 3):
        engine = spec_engine(mtp_checkpoint, k, kv_memory="16MiB", page_size=4)
        assert engine_greedy(engine, prompts, NUM_TOKENS) == expected
        stats = engine.proposer.stats
        assert stats.num_draft_tokens > 0 and len(stats.accepted_per_pos) == k
        assert engine.block_manager.num_prefix_hits >= 5  # the shared prompt pages
        assert engine.block_manager.num_free_pages == engine.block_manager.num_pages  # drafts' pages back


def test_greedy_with_forced_preemption(tiny_checkpoint) -> None:
    path = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    prompts = shared_prefix_prompts()
    expected = engine_greedy(
        Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB")), prompts, 32
    )
    tight = engine_with_pages(path, 24, decode_reserve_ratio=0.0, speculative="mtp", num_speculative_tokens=2)
    assert engine_greedy(tight, prompts, 32) == expected
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_pages == tight.block_manager.num_pages  # (fewer: the MTP layer's)


def test_refusals(tiny_checkpoint) -> None:
    with pytest.raises(KvqError, match="num_nextn_predict_layers"):
        spec_engine(tiny_checkpoint("glm_moe_dsa", "bf16"), 1, kv_memory="4MiB")
    with pytest.raises(KvqError, match="speculative mtp drafts with MTP"):
        spec_engine(tiny_checkpoint("llama", "bf16"), 1, kv_memory="4MiB")
    with pytest.raises(KvqError, match="--num-speculative-tokens must be >= 1"):
        EngineConfig(model=str(tiny_checkpoint("llama", "bf16")), speculative="mtp", num_speculative_tokens=0)


def test_max_tokens_and_stop_are_respected(tiny_checkpoint) -> None:
    path = tiny_checkpoint("deepseek_v3", "bf16", num_mtp_layers=1)
    prompt = shared_prefix_prompts()[0]
    plain = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    full = plain.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    engine = spec_engine(path, 3, kv_memory="16MiB")
    for max_tokens in (1, 2, 5):
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
        assert out.token_ids == full[:max_tokens] and out.finish_reason == "length"
    stop = full[6]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert out.token_ids == full[: full.index(stop) + 1] and out.finish_reason == "stop"


@pytest.mark.slow
def test_fitted_mtp_is_accepted(tiny_checkpoint, tmp_path: Path) -> None:
    from kvq.fixtures.mtp_fit import build_predictive_mtp

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (6 + i,), generator=gen).tolist() for i in range(4)]
    source = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1)
    path = build_predictive_mtp(source, tmp_path / "fit", prompts, 24, steps=200)
    plain = Engine(EngineConfig(model=str(path), dtype="float32", kv_memory="16MiB"))
    expected = engine_greedy(plain, prompts, 24)
    engine = spec_engine(path, 2, kv_memory="16MiB")
    assert engine_greedy(engine, prompts, 24) == expected
    stats = engine.proposer.stats
    assert stats.acceptance_rate > 0.5, stats
    assert engine.stats.num_steps < 0.75 * plain.stats.num_steps  # forwards of the model per token


@pytest.mark.slow
def test_tp2_greedy_is_tp1s(tiny_checkpoint) -> None:
    path = tiny_checkpoint("deepseek_v3", "bf16", num_mtp_layers=1)
    script = (
        "import json, sys\n"
        "from kvq.runtime.config import EngineConfig\nfrom kvq.runtime.engine import Engine\n"
        "from kvq.runtime.sampling import SamplingParams\n"
        "e = Engine(EngineConfig(model=sys.argv[1], tp=int(sys.argv[2]), dtype='float32', kv_memory='4MiB',"
        " threads=1, speculative=sys.argv[3] or None, num_speculative_tokens=2))\n"
        "prompts = [[1, 5, 9, 200, 33, 7, 8, 9, 10, 11, 12, 13][: 5 + 3 * i] for i in range(3)]\n"
        "outs = e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))\n"
        "print(json.dumps([o.token_ids for o in outs]))\ne.close()\n"
    )

    def run(tp: int, spec: str) -> list:
        done = subprocess.run(
            [sys.executable, "-c", script, str(path), str(tp), spec],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert run(2, "mtp") == run(1, "")
