"""read_dense: every stored format comes back as the dense weights it encodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from kvq.checkpoint.write import save_safetensors_atomic
from kvq.errors import KvqError
from kvq.formats.fp8_block import quantize_fp8_block
from kvq.formats.pack_quantized import dequantize_pack_quantized, pack_int4, unpack_int4


def test_pack_matches_compressed_tensors() -> None:
    q = torch.randint(-8, 8, (83, 544), dtype=torch.int8)
    packed = pack_int4(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed), q)


def test_read_dense_all_formats(tmp_path: Path) -> None:
    torch.manual_seed(0)
    w_fp8 = torch.randn(130, 200)
    fp8, scale_inv = quantize_fp8_block(w_fp8)
    q = torch.randint(-8, 8, (50, 256), dtype=torch.int8)
    weight_scale = torch.rand(50, 4).bfloat16()
    tensors = {
        "m.a.weight": fp8,
        "m.a.weight_scale_inv": scale_inv,
        "m.b.weight_packed": pack_int4(q),
        "m.b.weight_scale": weight_scale,
        "m.b.weight_shape": torch.tensor([50, 256]),
        "m.c.weight": fp8.clone(),
        "m.c.weight_scale": scale_inv.clone(),  # compressed-tensors float-quantized block form
        "m.d.weight": torch.randn(3, 4).bfloat16(),
        "m.d.bias": torch.randn(3).bfloat16(),
        "other.weight": torch.zeros(1),
    }
    save_safetensors_atomic(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({}))
    dense = read_dense(Checkpoint.open(tmp_path), "m.")
    assert set(dense) == {"m.a.weight", "m.b.weight", "m.c.weight", "m.d.weight", "m.d.bias"}
    expected_a = fp8.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :200]
    assert torch.equal(dense["m.a.weight"], expected_a)
    assert torch.equal(dense["m.c.weight"], expected_a)
    assert torch.equal(dense["m.b.weight"], q.float() * weight_scale.float().repeat_interleave(64, 1))
    assert torch.equal(dense["m.d.weight"], tensors["m.d.weight"].float())
    assert torch.equal(dequantize_pack_quantized(pack_int4(q), weight_scale), dense["m.b.weight"].bfloat16())


def test_read_dense_missing_scale(tmp_path: Path) -> None:
    fp8, _ = quantize_fp8_block(torch.randn(8, 8))
    save_safetensors_atomic({"m.a.weight": fp8}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KvqError, match="'m.a.weight' has no companion 'm.a.weight_scale'"):
        read_dense(Checkpoint.open(tmp_path), "m.")
