"""The benchmark's plumbing on tiny shapes (CPU, Triton launch path interpreted): it runs, checks, reports.

Times are not asserted: speed is measured by `scripts/gpu_check.sh` / `kvq bench`, not by tests.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kvq.bench.kernels import BenchConfig, evaluate_targets, run, smollm2_config
from kvq.runtime.kernels import KVQ_KERNELS_ENV

TINY = BenchConfig(
    gemv_shapes=(("tiny", 48, 256),), target_shapes=("tiny",), batches=(1, 3), group_size=64,
    num_experts=4, hidden=128, intermediate=64, top_k=2,
    attn_batch=2, attn_q_heads=4, attn_kv_heads=2, head_dim=64, page_size=16, contexts=(48,),
    copy_bytes=1 << 20, cpu_repeats=1,
)  # fmt: skip


def test_bench_runs_every_section_and_checks_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KVQ_KERNELS_ENV, "triton")
    result = run(TINY, torch.device("cpu"))
    assert result["errors"] == [] and result["mismatches"] == []
    assert [row["batch"] for row in result["w4a16_gemv"]] == [1, 3]
    assert all(row["backend"] == "triton" for row in result["w4a16_gemv"])
    assert [row["tokens"] for row in result["fused_moe"]] == [1, 3]
    assert {"bf16_time_us", "fp8_time_us", "fp8_speedup"} <= set(result["decode_attention"][0])
    names = [t["name"] for t in result["targets"]]
    assert len(names) == 3 and any("decode attention" in name for name in names)
    json.dumps(result)


def test_targets_compare_against_thresholds() -> None:
    result = {
        "w4a16_gemv": [dict(shape="tiny", batch=1, fraction_of_copy=0.7, speedup_vs_bf16=2.0)],
        "decode_attention": [dict(context=48, fp8_speedup=1.7)],
    }
    passed = [t["passed"] for t in evaluate_targets(TINY, result)]
    assert passed == [True, False, True]


def test_cpu_smollm2_config_times_the_decode_models_linears() -> None:
    """`--cpu --smollm2`: SmolLM2-135M's four Linears (group 64) through the CPU W4A16 path, each batch
    checked against the fp32 reference, and the path named next to the device."""
    cfg = replace(smollm2_config(replace(TINY, num_experts=0, contexts=())), batches=(1, 5))
    result = run(cfg, torch.device("cpu"))
    assert result["errors"] == [] and result["mismatches"] == []
    rows = [(row["shape"], row["N"], row["K"], row["batch"]) for row in result["w4a16_gemv"]]
    shapes = (("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536))
    assert rows == [(*shape, batch) for shape in shapes for batch in (1, 5)]
    assert all(row["group_size"] == 64 and row["max_rel_err"] < 2e-2 for row in result["w4a16_gemv"])
    assert result["device"].startswith("cpu; CPU W4A16 path: ")
