"""The FP8 e4m3 bit move is exact on every byte value, and the fast FP8-block decoder built on it equals
the reference dequantization bit for bit; NaN bytes are found."""

from __future__ import annotations

import pytest
import torch

from kvq.formats.fp8_block import decode_fp8_block, dequantize_fp8_block, quantize_fp8_block
from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE, first_nan, fp8_bits_to, has_nan

FP8 = torch.float8_e4m3fn

ALL_FINITE = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)


def test_fp8_bit_move_is_exact() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())]  # 254 finite codes, subnormals included
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(fp8_bits_to(codes, dtype).float() * FP8_BITS_SCALE, codes.float()), dtype
    for scale in (1.0, 0.0371, 3.5e-4):  # value * 2^-120 * (scale * 2^120) rounds once, like fp8 * scale
        found = fp8_bits_to(codes, torch.float32) * (torch.tensor(scale) * FP8_BITS_SCALE)
        assert torch.equal(found, codes.float() * scale), scale


def test_fp8_bit_move_reads_strided_views() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())][:252].reshape(12, 21).T  # non-contiguous
    assert torch.equal(fp8_bits_to(codes, torch.float32) * FP8_BITS_SCALE, codes.float())


@pytest.mark.parametrize("scale", [1.0, 3.7e-5, 2.0**-20, 1e-38, 0.0137, 250.0, 2.0**100])
def test_every_finite_byte_value(scale):
    weight = ALL_FINITE[torch.arange(254 * 2) % 254].reshape(4, 127).view(torch.float8_e4m3fn)
    scale_inv = torch.full((1, 1), scale)
    expected = dequantize_fp8_block(weight, scale_inv, (128, 128))
    assert torch.equal(decode_fp8_block(fp8_bits_to(weight), scale_inv, (128, 128)), expected)


@pytest.mark.parametrize("shape", [(300, 200), (128, 576), (83, 192), (1, 1)])
def test_partial_blocks_match_the_reference(shape):
    gen = torch.Generator().manual_seed(shape[0])
    weight, scale_inv = quantize_fp8_block(torch.randn(shape, generator=gen) * 0.05)
    scale_inv *= torch.rand(scale_inv.shape, generator=gen) + 0.5
    expected = dequantize_fp8_block(weight, scale_inv, (128, 128))
    assert torch.equal(decode_fp8_block(fp8_bits_to(weight), scale_inv, (128, 128)), expected)


def test_nan_bytes_are_found_both_signs():
    weight, _ = quantize_fp8_block(torch.randn(64, 64))
    weight.view(torch.uint8)[0, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)  # +-448, the largest
    assert not has_nan(weight) and not has_nan(weight[:0])
    for byte, where in ((0x7F, (3, 4)), (0xFF, (60, 1))):
        bad = weight.clone()
        bad.view(torch.uint8)[where] = byte
        assert has_nan(bad) and first_nan(bad) == where
