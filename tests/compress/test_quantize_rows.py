"""`quantize_rows` works through row chunks; every chunking gives the whole-tensor result, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvq.compress import torch_quantize
from kvq.compress.torch_quantize import quantize_rows
from kvq.formats.fp8_block import dequantize_fp8_block, quantize_fp8_block
from kvq.formats.pack_quantized import quantize_pack_int4


@pytest.mark.parametrize("chunk_elements", [1, 300 * 64, 1 << 20])
@pytest.mark.parametrize("shape", [(300, 192), (129, 64), (1, 256)])
def test_fp8_block_chunks_equal_the_whole_tensor(monkeypatch, chunk_elements, shape):
    monkeypatch.setattr(torch_quantize, "CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(shape[0])
    weight, scale_inv = quantize_fp8_block(torch.randn(shape, generator=gen) * 0.05)
    scale_inv *= torch.rand(scale_inv.shape, generator=gen) + 0.5  # every block row its own scales
    expected = quantize_pack_int4(dequantize_fp8_block(weight, scale_inv, (128, 128)).to(torch.bfloat16), 64)
    found = quantize_rows(weight, scale_inv, 64, (128, 128))
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dense_chunks_equal_the_whole_tensor(monkeypatch, dtype):
    monkeypatch.setattr(torch_quantize, "CHUNK_ELEMENTS", 7 * 96)  # 7 rows per chunk: the last one short
    weight = (torch.randn(50, 96, generator=torch.Generator().manual_seed(1)) * 0.02).to(dtype)
    expected = quantize_pack_int4(weight, 32)
    found = quantize_rows(weight, None, 32, (128, 128))
    assert found[1].dtype == dtype
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])
