"""Checkpoint.open: validation of directories, index and shard headers, and format detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvq.checkpoint.reader import Checkpoint, detect_format
from kvq.checkpoint.write import save_safetensors_atomic, write_index
from kvq.errors import KvqError


def make_sharded(root: Path) -> Path:
    """Three shards, the scale of `a` stored in a different shard from `a` itself."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shards = {
        "model-00001-of-00003.safetensors": {
            "model.layers.0.self_attn.q_proj.weight": torch.randn(130, 64).to(torch.float8_e4m3fn)
        },
        "model-00002-of-00003.safetensors": {
            "model.layers.0.self_attn.q_proj.weight_scale_inv": torch.rand(2, 1)
        },
        "model-00003-of-00003.safetensors": {
            "model.embed_tokens.weight": torch.randn(33, 64).bfloat16(),
            "model.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        },
    }
    weight_map, total = {}, 0
    for name, tensors in shards.items():
        save_safetensors_atomic(tensors, root / name)
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    write_index(root, weight_map, total)
    return root


def test_open_reads_index_and_headers(tmp_path: Path) -> None:
    ckpt = Checkpoint.open(make_sharded(tmp_path / "m"))
    assert len(ckpt.shards) == 3
    assert ckpt.format == "fp8-block"
    info = ckpt.info("model.layers.0.self_attn.q_proj.weight_scale_inv")
    assert info.file.name == "model-00002-of-00003.safetensors"
    assert info.shape == (2, 1) and info.dtype == "F32"
    got = ckpt.read_many(["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(got["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert ckpt.tensor_bytes == sum(h.data_bytes for h in ckpt.shards.values())


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda r: (r / "model-00002-of-00003.safetensors").unlink(),
            "names shard model-00002-of-00003.safetensors, which is missing",
        ),
        (lambda r: (r / "config.json").unlink(), "no config.json found"),
        (lambda r: (r / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda r: (r / "model.safetensors.index.json").write_text("{}"), "has no 'weight_map'"),
    ],
)
def test_broken_directories_name_the_problem(tmp_path: Path, damage, message: str) -> None:
    root = make_sharded(tmp_path / "m")
    damage(root)
    with pytest.raises(KvqError, match=message):
        Checkpoint.open(root)


def test_truncated_and_corrupt_shards(tmp_path: Path) -> None:
    root = make_sharded(tmp_path / "m")
    shard = root / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(KvqError, match=r"model-00003-of-00003.safetensors: tensor .* ends at byte"):
        Checkpoint.open(root)
    shard.write_bytes(data[:5])
    with pytest.raises(KvqError, match="too short for a safetensors header"):
        Checkpoint.open(root)
    shard.write_bytes(data[:8] + b"\xff" * (len(data) - 8))
    with pytest.raises(KvqError, match="header is not valid JSON"):
        Checkpoint.open(root)


def test_index_naming_a_tensor_the_shard_lacks(tmp_path: Path) -> None:
    root = make_sharded(tmp_path / "m")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00003.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KvqError, match="names tensor 'model.norm.weight' in model-00001-of-00003"):
        Checkpoint.open(root)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(KvqError, match="no such directory"):
        Checkpoint.open(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(KvqError, match="not a directory"):
        Checkpoint.open(tmp_path / "file")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KvqError, match="no \\*.safetensors files"):
        Checkpoint.open(tmp_path)


def test_detect_format_from_names_and_dtypes(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "config.json").write_text("{}")
    cases = {
        "bf16": {"a.weight": torch.zeros(2, 2, dtype=torch.bfloat16)},
        "pack-quantized": {
            "a.weight_packed": torch.zeros(2, 1, dtype=torch.int32),
            "a.weight_scale": torch.zeros(2, 1, dtype=torch.bfloat16),
        },
        "mixed": {
            "a.weight_packed": torch.zeros(2, 1, dtype=torch.int32),
            "b.weight": torch.zeros(2, 2).to(torch.float8_e4m3fn),
        },
    }
    for expected, tensors in cases.items():
        save_safetensors_atomic(tensors, root / "model.safetensors")
        assert Checkpoint.open(root).format == expected
        assert detect_format(Checkpoint.open(root).tensors.values()) == expected
