"""`kvq bench calibrate` building blocks: the linked working copy and the SmolLM2 perplexity table (measured
through the runtime: BF16 pages, FP8 pages at scale 1.0, FP8 pages with calibrated scales)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvq.bench.calibrate import CalibrateBenchConfig, linked_copy, measure_perplexity
from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from tests.calibrate.test_errors import snapshot
from tests.conftest import TinyCheckpoint


def test_linked_copy_calibrates_without_touching_the_source(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    source = tiny_checkpoint("llama", "bf16")
    before = snapshot(source)
    work = linked_copy(source, tmp_path / "work")
    assert all(p.is_symlink() for p in work.glob("model-*.safetensors"))
    calibrate(work, CalibrationConfig(dataset=small_dataset, num_samples=2, seq_len=32))
    assert snapshot(source) == before
    again = linked_copy(work, tmp_path / "again")  # a calibrated source: its scales are not carried over
    assert not (again / "kv_scales.safetensors").exists()
    calibrate(again, CalibrationConfig(dataset=small_dataset, num_samples=2, seq_len=32))


@pytest.mark.slow
def test_perplexity_rows(smollm2: object, tmp_path: Path) -> None:
    cfg = CalibrateBenchConfig(ppl_calib_samples=2, ppl_calib_seq_len=128, ppl_windows=2, ppl_seq_len=128)
    report = measure_perplexity(cfg, tmp_path)
    ppl = {row["kv_cache"]: row["perplexity"] for row in report["rows"]}
    assert len(ppl) == 4 and all(math.isfinite(v) and v > 1 for v in ppl.values())
    assert report["calibration"]["dataset"]["split"] == "calibration"
    assert "held_out" in report["eval_text"]
    assert report["method"].startswith("kvq runtime, scoring.perplexity")
