"""GPTQ on a model nested in a multimodal config (Kimi K2.5 / K2.6 layout: kimi_k25 + text_config, tensors
under `language_model.` beside a vision tower): the language model's layers are streamed and GPTQ'd under
their stored names, the vision tower is left alone, and the MLA latent's KV scales carry the prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.checkpoint.reader import Checkpoint, read_json
from kvq.compress.recipe import load_recipe
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import prepare_gptq, run_gptq
from tests.compress.test_nested_source import bf16_kimi
from tests.conftest import TinyCheckpoint


@pytest.mark.slow
def test_kimi_layout_is_gptqd_under_its_stored_names(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    src = bf16_kimi(tiny_checkpoint("deepseek_v3", "kimi-int4"), tmp_path / "src")
    config = GptqConfig(CalibrationConfig(num_samples=8, seq_len=64), moe_min_tokens=40, calibrate_kv=True)
    job = prepare_gptq(src, tmp_path / "out", load_recipe("w4a16-experts", 32), config)
    report = run_gptq(job, workers=2)
    int4 = set(job.compress.plan.int4_modules)
    assert int4 and all(name.startswith("language_model.model.layers.") for name in int4)
    gptqd = {
        name
        for record in read_json(tmp_path / "out" / "kvq_manifest.json", "manifest")["gptq"]["layers"].values()
        for name, m in record["modules"].items()
        if m["method"] == "gptq"
    }
    assert gptqd and gptqd | set(report.rtn_fallback) == int4 and not gptqd & set(report.rtn_fallback)
    assert report.kv_scales_written
    out = Checkpoint.open(tmp_path / "out")
    assert "language_model.model.layers.0.self_attn.k_scale" in out.tensors
    assert out.tensors["vision_tower.encoder.blocks.0.wqkv.weight"].dtype == "BF16"
