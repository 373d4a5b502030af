"""The W8A16 kernel (the lm_head's INT8 runtime copy): the row quantization, every native CPU path against
the scalar C reference and `w8a16_reference` (irregular shapes, K past one fp32 tile, batch 1..130), the
output rounding, threads, each KVQ_CPU_ISA path through `w8a16_linear` (the torch op included), and the
prepare errors."""

from __future__ import annotations

import os

import pytest
import torch

from kvq.runtime.kernels.cpu.isa import runnable_isas
from kvq.runtime.kernels.cpu.w8a16 import (
    INT8_MAX,
    prepare_w8a16,
    quantize_int8_rows,
    w8a16_linear,
    w8a16_native,
    w8a16_reference,
)
from tests.runtime.cpu_isa import CPU_ISAS, SIMD_ISAS, needs_native
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel

# (N, K): N not a multiple of the 4-row tile, K not a multiple of 8 / 16 / 64 lanes (the scalar tails),
# K over the 1024-input fp32 tile (several tiles, a partial last one)
SHAPES = [(1, 1), (7, 37), (13, 576), (33, 100), (66, 1056), (5, 2500), (200, 384)]
BATCHES = [1, 2, 3, 8, 17, 64, 65]  # 65: two passes of 64 rows over a tile
# every native SIMD path: amx's tiles take the int8 weight exactly (bf16(q)) and the row scale on the fp32
# sums, so its batches (4+ bf16 rows, K a multiple of 32: 576, 1056, 384 above; pairs of strips up to 32
# rows, strip passes above) are fp32 sums of q * x like the others'
W8_SIMD_ISAS = [CPU_ISAS[0], *SIMD_ISAS]


def _random(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    return quantize_int8_rows(dense)


def test_rows_are_quantized_symmetrically_to_nearest() -> None:
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen) * 10
    dense[3] = 0.0  # an all-zero row: scale 1, every q 0
    weight, weight_scale = quantize_int8_rows(dense)
    assert weight.dtype == torch.int8 and weight_scale.dtype == torch.float32
    assert torch.equal(weight[3], torch.zeros(96, dtype=torch.int8)) and weight_scale[3] == 1.0
    rows = [r for r in range(40) if r != 3]
    assert (weight[rows].abs().amax(dim=1) == INT8_MAX).all()  # each row's largest |w| maps to 127
    error = (weight.float() * weight_scale[:, None] - dense).abs()
    assert (error <= weight_scale[:, None] / 2 * (1 + 1e-6)).all()  # within half a step: to nearest


@needs_native
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_scalar_reference_is_the_spec(out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    weight, scale = _random(out_features, in_features, gen)
    x = torch.randn(3, in_features, generator=gen)
    y = w8a16_native(x, weight, scale, "scalar")
    assert_close_rel(y, w8a16_reference(x, weight, scale), REL_TOL[torch.float32])


@pytest.mark.parametrize("isa", W8_SIMD_ISAS)
@pytest.mark.parametrize("num_rows", BATCHES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_simd_matches_scalar_reference(isa: str, num_rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + in_features)
    weight, scale = _random(out_features, in_features, gen)
    x = torch.randn(num_rows, in_features, generator=gen).to(torch.bfloat16)
    y = w8a16_native(x, weight, scale, isa, out_dtype=torch.float32)
    expected = w8a16_native(x, weight, scale, "scalar", out_dtype=torch.float32)
    assert_close_rel(y, expected, REL_TOL[torch.float32])
    assert torch.equal(w8a16_native(x, weight, scale, isa), y.to(torch.bfloat16))  # rounded once


@pytest.mark.parametrize("isa", W8_SIMD_ISAS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_simd_dtypes(isa: str, x_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    weight, scale = _random(37, 352, gen)
    scale = scale.to(scale_dtype)
    for num_rows in (1, 5, 40):
        x = torch.randn(num_rows, 352, generator=gen).to(x_dtype)
        y = w8a16_native(x, weight, scale, isa)
        assert y.dtype == x_dtype
        assert torch.equal(y, w8a16_native(x, weight, scale, isa, out_dtype=torch.float32).to(x_dtype))
        assert_close_rel(y, w8a16_reference(x, weight, scale), REL_TOL[x_dtype])


@pytest.mark.parametrize("isa", [*W8_SIMD_ISAS, pytest.param("scalar", marks=needs_native)])
def test_threads_do_not_change_results(isa: str) -> None:
    gen = torch.Generator().manual_seed(8)
    weight, scale = _random(301, 640, gen)
    xs = [torch.randn(m, 640, generator=gen).to(torch.bfloat16) for m in (1, 4, 130)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([w8a16_native(x, weight, scale, isa, out_dtype=torch.float32) for x in xs])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize("in_features", [576, 100])  # 100: not a multiple of 16, the torch op's limit
def test_every_cpu_path_through_the_linear(cpu_isa: str, in_features: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    weight, scale = _random(70, in_features, gen)
    w = prepare_w8a16(weight, scale)
    assert w.cpu_isa == cpu_isa
    x = torch.randn(2, 3, in_features, generator=gen).to(torch.bfloat16)  # leading dims are kept
    y = w8a16_linear(x, w)
    assert y.shape == (2, 3, 70) and y.dtype == torch.bfloat16
    assert_close_rel(y, w8a16_reference(x, weight, scale), REL_TOL[torch.bfloat16])
    assert w8a16_linear(x[:, :0], w).shape == (2, 0, 70)


def test_prepare_and_call_errors_name_the_problem() -> None:
    weight, scale = _random(8, 32, torch.Generator().manual_seed(1))
    with pytest.raises(TypeError, match="int8"):
        prepare_w8a16(weight.float(), scale)
    with pytest.raises(ValueError, match=r"weight_scale must be a float \[N\] = \[8\]"):
        prepare_w8a16(weight, scale[:4])
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 32\]"):
        w8a16_linear(torch.zeros(1, 16), prepare_w8a16(weight, scale))


@pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")
@pytest.mark.skipif(bool(os.environ.get("KVQ_SIMDE_CHECK")), reason="SIMDe's vdpbf16ps keeps denormals")
def test_avx512bf16_runs_vdpbf16ps_for_bf16_batches_only() -> None:
    """vdpbf16ps flushes denormal inputs to zero, the fp32 paths do not: which path ran, by its values."""
    weight, scale = torch.full((4, 40), 127, dtype=torch.int8), torch.ones(4)
    tiny = torch.full((2, 40), 1e-39)  # denormal in bf16 and fp32; 40 * 127e-39 is a normal fp32
    for x, batched in ((tiny.to(torch.bfloat16), True), (tiny.to(torch.bfloat16)[:1], False), (tiny, False)):
        y = w8a16_native(x, weight, scale, "avx512bf16", out_dtype=torch.float32)
        expected = w8a16_native(x, weight, scale, "avx512", out_dtype=torch.float32)
        assert expected.min() > 1e-37
        assert torch.equal(y, torch.zeros_like(y) if batched else expected), (x.dtype, x.shape[0])
