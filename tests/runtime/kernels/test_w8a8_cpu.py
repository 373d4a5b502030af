"""W8A8 on the W4A8 CPU kernels (`NativeW8A8`: 8-bit weights, `_w4a8_cpu.h`'s `wide`), each path that runs
here: the exact integer sums of q times the quantized activations, times the row scales, on irregular
shapes, chunks of 64 and 32, batches across the row groups and 64-row passes; both paths and thread counts
give the same bits; the packed layout; the bf16 row scales of `quantize_int8_rows`; within int8 rounding
of the W8A16 product."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.kernels.cpu.w4a8 import (
    NativeW8A8,
    quantize_activations,
    w8a8_chunk,
    w8a8_pack,
    w8a8_reference,
)
from kvq.runtime.kernels.cpu.w8a16 import quantize_int8_rows, w8a16_reference
from tests.runtime.kernels.kernel_cases import same_bits_on_every_path_and_thread_count
from tests.runtime.kernels.test_w4a8_cpu import PATHS, pytestmark  # noqa: F401  (the W4A8 kernels' skip)

SHAPES = [(1, 32), (15, 96), (17, 64), (33, 576), (100, 1056)]  # N off the 16-row tiles; K 64k, 32(2k+1)
ROWS = [1, 3, 4, 5, 64, 65, 70]


def _int8(num_rows: int, in_features: int, gen: torch.Generator, scale_dtype=torch.bfloat16):
    return quantize_int8_rows(torch.randn(num_rows, in_features, generator=gen) * 0.05, scale_dtype)


def _fp32_bound(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """|the per-chunk terms| summed, times the chunks: a bound on fp32's rounding of their sum."""
    chunk = w8a8_chunk(weight.shape[1])
    xq, xs = quantize_activations(x, chunk)
    chunks = weight.shape[1] // chunk
    q = weight.double().abs().view(weight.shape[0], chunks, chunk)
    sums = torch.einsum("mcj,ncj->mnc", xq.double().abs().view(-1, chunks, chunk), q)
    terms = sums * (weight_scale.float()[None, :, None] * xs.unsqueeze(1)).double()
    return terms.sum(-1) * chunks * 2.0**-23 + 1e-30


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_rows,in_features", SHAPES)
def test_fp32_output_is_the_exact_integer_sums_times_the_scales(num_rows, in_features, path) -> None:
    gen = torch.Generator().manual_seed(num_rows * 7 + in_features)
    weight, weight_scale = _int8(num_rows, in_features, gen)
    kernel = NativeW8A8(weight, weight_scale, path)
    assert kernel.chunk == (64 if in_features % 64 == 0 else 32)
    for m in ROWS:
        x = torch.randn(m, in_features, generator=gen) * 3
        y = kernel(x)
        expected = w8a8_reference(x, weight, weight_scale)
        assert y.shape == (m, num_rows) and y.dtype == torch.float32
        error = (y.double() - expected).abs()
        assert (error <= _fp32_bound(x, weight, weight_scale)).all(), (m, error.max())


def test_extreme_weights_and_activations_stay_exact() -> None:
    """q = +-127 everywhere and activations at +-amax: the largest sums (64 * 127 * 127), no saturation in
    AVX2's int16 pairs (the nibbles of u = q + 128 taken apart)."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.where(torch.rand(48, 128, generator=gen) < 0.5, 127, -127).to(torch.int8)
    weight_scale = torch.full((48,), 2.0**-7, dtype=torch.bfloat16)
    x = torch.sign(weight[:3].float() + 0.5) * 4.0  # rows 0-2: the signs of weight rows 0-2
    for path in PATHS:
        y = NativeW8A8(weight, weight_scale, path)(x)
        error = (y.double() - w8a8_reference(x, weight, weight_scale)).abs()
        assert (error <= _fp32_bound(x, weight, weight_scale)).all()
        # every product of row 0 +127 * 127: 2 chunks of 64 * 127 * 127, times 2^-7 and 4 / 127
        assert y[0, 0].item() == pytest.approx(508.0, rel=1e-6)


@pytest.mark.parametrize("in_features", [256, 384])
def test_paths_and_threads_give_the_same_bits(in_features) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, weight_scale = _int8(300, in_features, gen, torch.float32)  # fp32 scales as well
    xs = (torch.randn(9, in_features, generator=gen).bfloat16(), torch.randn(67, in_features, generator=gen))
    kernels = [NativeW8A8(weight, weight_scale, path) for path in PATHS]
    assert same_bits_on_every_path_and_thread_count(kernels, xs)
    assert kernels[0](xs[0]).dtype == torch.bfloat16


def test_the_packed_layout_holds_every_weight_once() -> None:
    gen = torch.Generator().manual_seed(4)
    weight, weight_scale = _int8(20, 192, gen)
    w, s = w8a8_pack(weight, weight_scale, 64)
    assert w.shape == (2, 3, 16, 64) and s.shape == (2, 1, 16)  # 2 tiles (rows 20..31 padding), 3 chunks
    # byte 4l + j of tile 0, chunk 1, vector 5: row l's input 64 + 20 + j, plus 128
    assert torch.equal(w[0, 1, 5].view(16, 4).to(torch.int16) - 128, weight[:16, 84:88].to(torch.int16))
    assert (w[1, :, :, 16:] == 128).all()  # the 12 padding rows are q = 0
    assert s.dtype == torch.bfloat16 and (s[1, :, 4:] == 0).all() and torch.equal(s[0, 0], weight_scale[:16])


def test_bf16_row_scales_are_rounded_up() -> None:
    dense = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)) * 0.02
    dense[3] = 0.0
    weight, scale = quantize_int8_rows(dense, torch.bfloat16)
    _, scale32 = quantize_int8_rows(dense)
    assert scale.dtype == torch.bfloat16 and (scale.float() >= scale32).all()
    assert (scale.float() <= scale32 * (1 + 2.0**-7)).all() and scale[3] == 1
    assert weight.abs().amax(dim=1)[torch.arange(64) != 3].min() >= 126  # each row's max still near 127
    assert torch.equal(weight, torch.round(dense / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))


def test_within_int8_rounding_of_the_w8a16_product() -> None:
    gen = torch.Generator().manual_seed(6)
    weight, weight_scale = _int8(64, 1024, gen)
    x = torch.randn(16, 1024, generator=gen).bfloat16()
    exact = w8a16_reference(x, weight, weight_scale.float()).double()
    y = NativeW8A8(weight, weight_scale)(x).double()
    # the activations' int8 rounding per 64 inputs: ~0.3-0.6% of the output's norm on Gaussian ones
    assert (y - exact).norm() / exact.norm() < 0.01


def test_chunk_needs_k_a_multiple_of_32() -> None:
    assert (w8a8_chunk(576), w8a8_chunk(96), w8a8_chunk(100)) == (64, 32, None)
