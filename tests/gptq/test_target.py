"""`kvq compress --method gptq --target sglang` on an FP8-block MoE source: the experts GPTQ'd (or listed as
RTN fallback), every FP8 weight not quantized written as BF16 (listed), and `kvq check` finds that SGLang
loads it, exactly as for the RTN path."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.check import check_checkpoint
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.recipe import load_recipe
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import prepare_gptq, run_gptq
from tests.conftest import TinyCheckpoint


@pytest.mark.slow
def test_sglang_target_writes_fp8_as_bf16_beside_gptq_experts(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src, out = tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path / "out"
    config = GptqConfig(CalibrationConfig(num_samples=8, seq_len=64), moe_min_tokens=40)
    job = prepare_gptq(src, out, load_recipe("w4a16-experts", 64), config, "sglang")
    report = run_gptq(job, workers=2)
    assert report.num_gptq and report.num_gptq + len(report.rtn_fallback) == len(
        job.compress.plan.int4_modules
    )
    dequantized = {kept.name for kept in job.compress.plan.dequantized}
    assert "model.layers.0.self_attn.q_proj.weight" in dequantized
    ckpt = Checkpoint.open(out)
    assert not [n for n, info in ckpt.tensors.items() if info.dtype == "F8_E4M3"]
    assert all(ckpt.tensors[name].dtype == "BF16" for name in dequantized)
    assert check_checkpoint(out, ["sglang"]).loads("sglang")
