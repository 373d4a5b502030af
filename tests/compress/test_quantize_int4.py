"""kvq's vectorized W4A16 quantizer and packer are bit-identical to compressed-tensors' (the oracle)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from kvq.formats.pack_quantized import (
    dequantize_pack_quantized,
    pack_int4,
    quantize_int4_group,
    quantize_pack_int4,
    unpack_int4,
)
from tests.compress.oracle import library_quantize

CASES = [
    ((83, 384), 128, torch.bfloat16),
    ((50, 96), 32, torch.bfloat16),
    ((7, 64), 64, torch.float16),
    ((129, 256), 128, torch.float32),
    ((3, 1024), 64, torch.bfloat16),
]


@pytest.mark.parametrize(("shape", "group_size", "dtype"), CASES)
def test_matches_compressed_tensors(shape, group_size, dtype):
    gen = torch.Generator().manual_seed(hash((shape, group_size)) % 2**31)
    weight = (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 0.1).to(dtype)
    weight[0, :group_size] = 0  # an all-zero group: its scale becomes the dtype's eps
    expected = library_quantize(weight, group_size)
    packed, weight_scale = quantize_pack_int4(weight, group_size)
    assert weight_scale.dtype == dtype
    assert torch.equal(packed, expected["weight_packed"])
    assert torch.equal(weight_scale, expected["weight_scale"])
    q, scale_again = quantize_int4_group(weight, group_size)
    assert torch.equal(scale_again, weight_scale) and torch.equal(pack_int4(q), packed)


def test_ties_round_half_to_even():
    # absmax 7.5 -> scale exactly 1.0, so w / scale lands on x.5 ties.
    row = torch.tensor([7.5, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4, dtype=torch.bfloat16)
    q, scale = quantize_int4_group(row.reshape(1, 32), 32)
    assert scale.item() == 1.0
    assert q[0, :8].tolist() == [7, 0, 2, 2, 0, -2, -2, 4]
    assert torch.equal(pack_int4(q), library_quantize(row.reshape(1, 32), 32)["weight_packed"])


def test_pack_is_bit_identical_to_pack_to_int32():
    q = torch.randint(-8, 8, (37, 520), dtype=torch.int8)
    packed = pack_int4(q)
    assert torch.equal(packed, pack_to_int32(q, 4))
    assert torch.equal(unpack_int4(packed), q)


def test_dequantize_inverts_quantize_within_one_step():
    # scale = absmax / 7.5 but q stops at 7, so the largest positive value may be off by a whole step.
    weight = torch.randn(64, 256).bfloat16()
    packed, scale = quantize_pack_int4(weight, 128)
    dense = dequantize_pack_quantized(packed, scale, (64, 256), torch.float32)
    step = scale.float().repeat_interleave(128, dim=1)
    assert bool(((dense - weight.float()).abs() <= step * 1.001).all())


def test_input_is_not_modified():
    weight = torch.randn(4, 64)
    before = weight.clone()
    quantize_pack_int4(weight, 32)
    assert torch.equal(weight, before)


def test_rejects_in_features_not_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="not a multiple of group_size 128"):
        quantize_pack_int4(torch.randn(4, 192), 128)
