"""`calibrate()` end to end: what lands in the checkpoint, and that loaders read it back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvq.calibrate.calibrate_checkpoint import calibrate
from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.calibrate.scales_record import FILE_KEY, MANIFEST_NAME, SCALES_FILE, file_record
from kvq.checkpoint.reader import INDEX_NAME, Checkpoint
from kvq.checkpoint.write import save_safetensors_atomic
from tests.calibrate.conftest import writable
from tests.conftest import TinyCheckpoint


def small(dataset: Path | None, **kwargs: object) -> CalibrationConfig:
    return CalibrationConfig(dataset=dataset, num_samples=4, seq_len=64, **kwargs)  # type: ignore[arg-type]


def test_writes_shard_index_config_and_manifest(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path)
    (root / MANIFEST_NAME).write_text(json.dumps({"compress": {"kept": True}}))
    result = calibrate(root, small(small_dataset))

    stored = load_file(root / SCALES_FILE)
    assert (
        sorted(stored)
        == sorted(result.scales)
        == sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in range(2) for s in "kv")
    )
    assert all(torch.equal(stored[n], result.scales[n]) and stored[n].dtype == torch.bfloat16 for n in stored)
    ckpt = Checkpoint.open(root)  # the index names the new shard and still matches every shard
    assert ckpt.tensors["model.layers.1.self_attn.v_scale"].file.name == SCALES_FILE
    index = json.loads((root / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == ckpt.tensor_bytes
    qc = ckpt.quantization_config
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"] == {}
    assert qc["kv_cache_scheme"] == {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    assert manifest["compress"] == {"kept": True}
    record = manifest["kv_calibration"]
    assert record["dataset"]["token_ids_sha256"] == result.samples.fingerprint
    assert (record["num_samples"], record["seq_len"], record["seed"]) == (4, 64, 0)
    assert record["layers"][1]["k_scale"] == [result.scales["model.layers.1.self_attn.k_scale"].item()]
    assert record["layers"][1]["num_tokens"] == 4 * 64
    assert record["layers"][0]["amax"]["k"] == result.recorder.amax[0]["k"].tolist()


def test_transformers_loads_the_scales(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    """transformers + compressed-tensors read the kv_cache_scheme and load k_scale/v_scale as written.

    (llama: transformers 5.17 cannot load a kv-only compressed-tensors config on a MoE model, its
    `get_experts_scheme` indexes the empty `config_groups`; llm-compressor's own kv-only output fails too.)
    """
    from transformers import AutoModelForCausalLM

    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path)
    result = calibrate(root, small(small_dataset, strategy="attn_head"))
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16)
    loaded = {n: p for n, p in model.named_parameters() if n.endswith(("k_scale", "v_scale"))}
    assert sorted(loaded) == sorted(result.scales)
    for name, scale in result.scales.items():
        assert torch.equal(loaded[name].detach().flatten(), scale.flatten()), name


def test_kimi_native_checkpoint_gets_prefixed_scales_and_a_nested_scheme(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    root = writable(tiny_checkpoint("deepseek_v3", "kimi-int4"), tmp_path)
    result = calibrate(root, small(small_dataset))
    assert sorted(result.scales) == sorted(
        f"language_model.model.layers.{i}.self_attn.{s}_scale" for i in range(3) for s in "kv"
    )
    assert sorted(load_file(root / SCALES_FILE)) == sorted(result.scales)
    config = json.loads((root / "config.json").read_text())
    assert "quantization_config" not in config  # still where Kimi keeps it, with the KV scheme added
    nested = config["text_config"]["quantization_config"]
    assert nested["format"] == "pack-quantized" and nested["kv_cache_scheme"]["strategy"] == "tensor"
    assert nested["config_groups"]["group_0"]["weights"]["group_size"] == 32
    ckpt = Checkpoint.open(root)
    assert ckpt.quantization_config == nested and ckpt.format == "pack-quantized"
    latent = torch.maximum(result.recorder.amax[2]["kv_c"], result.recorder.amax[2]["k_pe"])
    assert (
        result.scales["language_model.model.layers.2.self_attn.k_scale"].item()
        == (latent / 448).bfloat16().item()
    )


def test_recalibration_replaces_previous_scales(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    root = writable(tiny_checkpoint("llama", "bf16"), tmp_path)
    calibrate(root, small(small_dataset))
    again = calibrate(root, small(small_dataset, strategy="attn_head", seed=1))
    ckpt = Checkpoint.open(root)
    assert ckpt.tensors["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
    assert [p.name for p in root.glob("kv_scales*")] == [SCALES_FILE]
    assert ckpt.quantization_config["kv_cache_scheme"]["strategy"] == "attn_head"
    record = json.loads((root / MANIFEST_NAME).read_text())["kv_calibration"]
    assert record["seed"] == 1 and record["dataset"]["token_ids_sha256"] == again.samples.fingerprint


def test_same_settings_same_samples(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    """Default corpus (gensim Wikipedia): deterministic selection, recorded fingerprint, identical scales."""
    first = calibrate(writable(tiny_checkpoint("llama", "bf16"), tmp_path / "a"), small(None))
    second = calibrate(writable(tiny_checkpoint("llama", "bf16"), tmp_path / "b"), small(None))
    assert first.samples.fingerprint == second.samples.fingerprint
    assert first.record["dataset"]["split"] == "calibration"
    assert all(torch.equal(first.scales[n], second.scales[n]) for n in first.scales)


def test_fp8_block_source_keeps_its_quant_method(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    root = writable(tiny_checkpoint("glm4_moe", "fp8-block"), tmp_path)
    before = Checkpoint.open(root).quantization_config
    calibrate(root, small(small_dataset))
    qc = Checkpoint.open(root).quantization_config
    assert qc == {**before, "kv_cache_scheme": qc["kv_cache_scheme"]}
    assert qc["quant_method"] == "fp8" and qc["kv_cache_scheme"]["strategy"] == "tensor"


def test_single_file_checkpoint_gets_an_index(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path, small_dataset: Path
) -> None:
    src = Checkpoint.open(tiny_checkpoint("llama", "bf16"))
    root = writable(src.root, tmp_path)
    for name in list(src.shards):
        (root / name).unlink()
    (root / INDEX_NAME).unlink()
    save_safetensors_atomic(src.read_many(src.tensors), root / "model.safetensors")
    calibrate(root, small(small_dataset))
    ckpt = Checkpoint.open(root)
    assert set(ckpt.shards) == {"model.safetensors", SCALES_FILE}
    assert ckpt.tensors["model.embed_tokens.weight"].file.name == "model.safetensors"


@pytest.mark.parametrize("producer, arch", [("kvq compress", "glm_moe_dsa"), ("model_free_ptq", "llama")])
def test_compressed_checkpoint(
    int4_by: Callable[[str, str], Path], tmp_path: Path, small_dataset: Path, producer: str, arch: str
) -> None:
    """An INT4 checkpoint (glm_moe_dsa: MLA + DSA, unpatched) keeps its config groups and manifest keys."""
    root = writable(int4_by(producer, arch), tmp_path)
    manifest_before = (
        json.loads((root / MANIFEST_NAME).read_text()) if (root / MANIFEST_NAME).exists() else {}
    )
    result = calibrate(root, small(small_dataset))
    qc = Checkpoint.open(root).quantization_config
    assert qc["format"] in ("pack-quantized", "mixed-precision") and qc["config_groups"]
    assert qc["kv_cache_scheme"]["strategy"] == "tensor"
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    written = file_record((root / SCALES_FILE).read_bytes())
    assert manifest == {**manifest_before, "kv_calibration": result.record, FILE_KEY: written}
    if arch == "glm_moe_dsa":
        assert result.layout.is_mla and result.record["layers"][0]["amax"].keys() == {"kv_c", "k_pe"}
    assert all(s.item() > 0 for s in result.scales.values())
