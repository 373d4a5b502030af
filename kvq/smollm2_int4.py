"""The embedded SmolLM2's INT4 build: `kvq compress` (w4a16-linear) then `kvq calibrate` (FP8 KV scales),
made once under `kvq.paths.cache_dir()/bench`. A config file's `embedded:smollm2-int4` and `kvq bench
decode`'s INT4 contender. Imports kvq.compress and kvq.calibrate when it builds.
"""

from __future__ import annotations

from pathlib import Path

from kvq.paths import cache_dir


def ensure_smollm2_int4(bf16: Path, group_size: int = 64, num_samples: int = 32, seq_len: int = 512) -> Path:
    """SmolLM2 (`bf16`, its BF16 checkpoint) compressed to INT4 with groups of `group_size` and calibrated on
    `num_samples` windows of `seq_len` tokens; built on first use, then found by its path."""
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig
    from kvq.compress.recipe import load_recipe
    from kvq.compress.runner import prepare, run

    path = cache_dir() / "bench" / f"smollm2-w4a16-g{group_size}-kv"
    if not (path / "kv_scales.safetensors").is_file():
        run(prepare(bf16, path, load_recipe("w4a16-linear", group_size)), workers=1)
        calibrate(path, CalibrationConfig(num_samples=num_samples, seq_len=seq_len))
    return path
