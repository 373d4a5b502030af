"""A GPTQ run interrupted between layers resumes at the first layer not finished and ends byte-identical;
a finished run re-run changes nothing; the KV scales of `calibrate_kv` are what `kvq calibrate` measures
on the output.

FP8-block source (every layer dequantized on the fly), every Linear GPTQ'd with group 64.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import read_manifest
from kvq.compress.recipe import load_recipe
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import GptqReport, prepare_gptq, run_gptq
from kvq.gptq.staging import STAGING_DIR, state_path
from tests.calibrate.test_errors import snapshot
from tests.calibrate.test_oracle import BF16_ULP
from tests.conftest import TinyCheckpoint

CALIBRATION = CalibrationConfig(num_samples=10, seq_len=64)
CONFIG = GptqConfig(CALIBRATION, calibrate_kv=True)


class Interrupted(Exception):
    pass


def stop_after_first_layer(layer_idx: int) -> None:
    raise Interrupted(layer_idx)


def gptq(src: Path, out: Path, **kwargs) -> GptqReport:  # noqa: ANN003
    return run_gptq(prepare_gptq(src, out, load_recipe("w4a16-linear", 64), CONFIG), 2, **kwargs)


def interrupted(src: Path, out: Path) -> None:
    with pytest.raises(Interrupted):
        gptq(src, out, on_layer_done=stop_after_first_layer)
    manifest = read_manifest(out)
    assert manifest is not None and not manifest["complete"] and list(manifest["gptq"]["layers"]) == ["0"]
    assert not list(out.glob("*.safetensors"))  # no shard under a final name before its layers are done


@pytest.mark.slow
def test_interrupted_run_resumes_byte_identical(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "fp8-block")
    source_files = snapshot(src)
    whole = tmp_path / "whole"
    report = gptq(src, whole)
    assert report.layers_done == [0, 1] and report.num_gptq == 14 and report.kv_scales_written
    assert not (whole / STAGING_DIR).exists()
    expected = snapshot(whole)

    out = tmp_path / "out"
    interrupted(src, out)
    report = gptq(src, out)
    assert (report.layers_resumed, report.layers_done) == (1, [1])
    assert snapshot(out) == expected

    lost = tmp_path / "lost-state"  # the hidden states after layer 0 are gone: start again from layer 0
    interrupted(src, lost)
    state_path(lost, 0).unlink()
    assert gptq(src, lost).layers_done == [0, 1]
    assert snapshot(lost) == expected

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    report = gptq(src, out)  # complete: nothing to do
    assert report.layers_done == [] and not report.compress.shards_written and not report.kv_scales_written
    assert snapshot(out) == expected and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    assert snapshot(src) == source_files

    # the scales written in the GPTQ pass are those kvq calibrate measures on the quantized output, to one
    # bf16 step: both carry bf16 hidden states through the layers with matmuls of different shapes, which
    # AVX-512 BF16 CPUs round differently (seen: layer 1's v_scale 0.0033264 vs 0.0033112, one step apart)
    calibrated = calibrate(shutil.copytree(whole, tmp_path / "calibrated"), CALIBRATION)
    written = Checkpoint.open(whole)
    for name, scale in calibrated.scales.items():
        got = written.read(name).float()
        torch.testing.assert_close(got, scale.float(), rtol=2 * BF16_ULP, atol=0, msg=name)
