"""The W4A8 CPU kernels (`kernels.cpu.w4a8`, `_w4a8_cpu.h`), each that runs here (AVX-512 VNNI, AVX2): their
sums are the exact integer sums of q times the quantized activations, times the scales, on irregular shapes,
every group size, batches across their row groups and 64-row passes, every activation dtype; both paths give
the same bits; the activations are `quantize_activations`'; the result stays within int8 rounding of the
W4A16 product."""

from __future__ import annotations

import pytest
import torch

from kvq.formats.pack_quantized import unpack_int4
from kvq.runtime.kernels.cpu.w4a8 import (
    NativeW4A8,
    quantize_activations,
    w4a8_chunk,
    w4a8_pack,
    w4a8_reference,
    w4a8_runnable,
)
from kvq.runtime.kernels.w4a16 import w4a16_reference
from tests.runtime.kernels.kernel_cases import random_w4a16, same_bits_on_every_path_and_thread_count

PATHS = w4a8_runnable()
pytestmark = pytest.mark.skipif(not PATHS, reason="no W4A8 kernel runs here (AVX2 and kvq's CPU extension)")

SHAPES = [  # (N, K, group): N off the 16-row tiles, K one chunk to many
    (1, 32, 32),
    (15, 96, 32),
    (17, 64, 64),
    (33, 576, 64),
    (50, 256, 128),
    (100, 1536, 128),
]
ROWS = [1, 2, 3, 4, 5, 7, 64, 65, 70]


def _fp32_bound(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """|the per-chunk terms| summed, times the chunks: a bound on fp32's rounding of their sum."""
    chunk = w4a8_chunk(group)
    xq, xs = quantize_activations(x, chunk)
    q = unpack_int4(packed).double().abs()
    chunks = q.shape[1] // chunk
    sums = torch.einsum("mcj,ncj->mnc", xq.double().abs().view(-1, chunks, chunk), q.view(-1, chunks, chunk))
    ws = scale.float().repeat_interleave(group // chunk, dim=1)
    terms = sums * (ws.unsqueeze(0) * xs.unsqueeze(1)).double()
    return terms.sum(-1) * chunks * 2.0**-23


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_rows,in_features,group", SHAPES)
def test_fp32_output_is_the_exact_integer_sums_times_the_scales(num_rows, in_features, group, path) -> None:
    gen = torch.Generator().manual_seed(num_rows * 7 + in_features)
    packed, scale = random_w4a16(num_rows, in_features, group, gen)
    kernel = NativeW4A8(packed, scale, group, path)
    for m in ROWS:
        x = torch.randn(m, in_features, generator=gen) * 3
        y = kernel(x)
        expected = w4a8_reference(x, packed, scale, group)
        assert y.shape == (m, num_rows) and y.dtype == torch.float32
        bound = _fp32_bound(x, packed, scale, group) + 1e-30
        assert ((y.double() - expected).abs() <= bound).all(), (m, (y.double() - expected).abs().max())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,half_ulp", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
def test_16_bit_activations_and_outputs(dtype, half_ulp, path) -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale = random_w4a16(40, 192, 64, gen)
    x = torch.randn(6, 192, generator=gen).to(dtype)
    y = NativeW4A8(packed, scale, 64, path)(x)
    assert y.dtype == dtype
    expected = w4a8_reference(x, packed, scale, 64)  # the same activations, read from 16 bits
    # the fp32 result rounded once to the output dtype
    bound = _fp32_bound(x, packed, scale, 64) * (1 + half_ulp) + expected.abs() * half_ulp + 1e-30
    assert ((y.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_paths_and_threads_give_the_same_bits(group) -> None:
    gen = torch.Generator().manual_seed(2)
    packed, scale = random_w4a16(300, 512, group, gen)
    xs = (torch.randn(9, 512, generator=gen).bfloat16(), torch.randn(67, 512, generator=gen))
    kernels = [NativeW4A8(packed, scale, group, path) for path in PATHS]
    assert same_bits_on_every_path_and_thread_count(kernels, xs)


@pytest.mark.parametrize("path", PATHS)
def test_activations_per_chunk(path) -> None:
    x = torch.zeros(3, 128)
    x[0, :64] = torch.linspace(-2, 1, 64)
    x[0, 64:] = 1e-3
    x[1, 5] = float("inf")  # row 1's first chunk holds inf; row 2 is all zero
    xq, xs = quantize_activations(x, 64)
    assert xq[0, 0] == -127 and xs[0, 0] == pytest.approx(2 / 127) and (xq[0, 64:] == 127).all()
    assert (xq[2] == 0).all() and (xs[2] == 0).all()
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_w4a16(20, 128, 64, gen)
    y = NativeW4A8(packed, scale, 64, path)(x)
    assert torch.isnan(y[1]).all() and (y[2] == 0).all() and torch.isfinite(y[0]).all()
    expected = w4a8_reference(x[:1], packed, scale, 64)
    assert (y[0].double() - expected[0]).abs().max() <= _fp32_bound(x[:1], packed, scale, 64).max() + 1e-30


def test_the_packed_layout_holds_every_weight_once() -> None:
    gen = torch.Generator().manual_seed(4)
    packed, scale = random_w4a16(20, 192, 64, gen)
    w, s = w4a8_pack(packed, scale, 64)
    assert w.shape == (2, 3, 8, 64) and s.shape == (2, 3, 16)  # 2 tiles (rows 20..31 padding), 3 chunks
    nibbles = torch.cat([w & 15, w >> 4]).flatten().bincount(minlength=16)
    assert nibbles.sum() == 32 * 192 and nibbles[8] >= 12 * 192  # the 12 padding rows are q = 0
    assert s.dtype == torch.bfloat16 and (s[1, :, 4:] == 0).all() and torch.equal(s[0, 1, :], scale[:16, 1])


@pytest.mark.parametrize("group", [32, 64, 128])
def test_within_int8_rounding_of_the_w4a16_product(group) -> None:
    gen = torch.Generator().manual_seed(5)
    packed, scale = random_w4a16(64, 1024, group, gen)
    x = torch.randn(16, 1024, generator=gen).bfloat16()
    exact = w4a16_reference(x, packed, scale, group).double()
    y = NativeW4A8(packed, scale, group)(x.float()).double()
    # int8 per chunk: each activation within amax / 254 of its value, so the error is ~0.3-0.6% of the
    # output's norm on Gaussian activations
    assert (y - exact).norm() / exact.norm() < 0.01


@pytest.mark.parametrize("path", PATHS)
def test_fp32_scales_bf16_cannot_hold(path) -> None:
    gen = torch.Generator().manual_seed(6)
    packed, scale = random_w4a16(24, 256, 128, gen)
    scale = scale.float() * (1 + 2.0**-12)  # off bf16's grid
    w, s = w4a8_pack(packed, scale, 128)
    assert s.dtype == torch.float32
    x = torch.randn(5, 256, generator=gen)
    y = NativeW4A8(packed, scale, 128, path)(x)
    expected = w4a8_reference(x, packed, scale, 128)
    assert ((y.double() - expected).abs() <= _fp32_bound(x, packed, scale, 128) + 1e-30).all()
    assert not torch.equal(y, NativeW4A8(packed, scale.bfloat16(), 128, path)(x))
