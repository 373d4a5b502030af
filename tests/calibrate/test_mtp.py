"""`calibrate()` on checkpoints with an MTP layer: its own attention gets k/v scales, measured on inputs
computed as the engines draft (enorm(embed(next token)), hnorm(final hidden), eh_proj, decoder layer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.calibrate.scales_record import MANIFEST_NAME, SCALES_FILE
from kvq.check import check_checkpoint
from tests.calibrate.conftest import writable
from tests.conftest import TinyCheckpoint

MTP_LAYER = 3


@pytest.mark.parametrize(("arch", "fmt"), [("glm_moe_dsa", "fp8-block"), ("deepseek_v3", "bf16")])
def test_mtp_layer_gets_finite_positive_scales(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path, arch: str, fmt: str
) -> None:
    root = writable(tiny_checkpoint(arch, fmt, num_mtp_layers=1), tmp_path)
    result = calibrate(root, CalibrationConfig(dataset=small_dataset, num_samples=4, seq_len=64))
    stored = load_file(root / SCALES_FILE)
    names = {f"model.layers.{i}.self_attn.{s}_scale" for i in range(MTP_LAYER + 1) for s in "kv"}
    assert set(stored) == set(result.scales) == names
    k_scale = stored[f"model.layers.{MTP_LAYER}.self_attn.k_scale"]
    assert k_scale.dtype == torch.bfloat16 and k_scale.shape == (1,)
    assert torch.isfinite(k_scale).all() and (k_scale > 0).all()
    # its own observation, on 4 x 63 positions (each has a next token), not a copy of the last layer's
    assert result.recorder.num_tokens[MTP_LAYER] == 4 * 63 and result.recorder.num_tokens[2] == 4 * 64
    assert not torch.equal(result.recorder.amax[MTP_LAYER]["kv_c"], result.recorder.amax[2]["kv_c"])
    layers = json.loads((root / MANIFEST_NAME).read_text())["kv_calibration"]["layers"]
    assert [entry["layer"] for entry in layers] == [0, 1, 2, MTP_LAYER]
    assert layers[-1]["k_scale"] == k_scale.float().tolist()


def test_check_warns_when_only_the_mtp_layer_is_uncalibrated(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    root = writable(tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1), tmp_path)
    calibrate(root, CalibrationConfig(dataset=small_dataset, num_samples=2, seq_len=32))
    assert check_checkpoint(root, ["vllm"]).verdict("vllm").mtp_findings == []
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for s in "kv":  # drop the MTP layer's scales from the index: main layers calibrated, MTP not
        del index["weight_map"][f"model.layers.{MTP_LAYER}.self_attn.{s}_scale"]
    kept = {n: t for n, t in load_file(root / SCALES_FILE).items() if f".{MTP_LAYER}." not in n}
    save_file(kept, root / SCALES_FILE)
    index_path.write_text(json.dumps(index))
    verdict = check_checkpoint(root, ["vllm"]).verdict("vllm")
    assert [(f.rule, f.where) for f in verdict.mtp_findings] == [
        ("vllm.mtp-kv-scales-missing", f"model.layers.{MTP_LAYER}.self_attn.k_scale")
    ]
    assert verdict.loads_mtp is True  # a warning: it loads, at scale 1.0
