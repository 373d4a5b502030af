"""The avx512bf16 (and amx) path's batch-1 GEMV on integer dot products (`_w4a16_cpu_vnni.h`), against
float64 sums: exact integer lane sums (error only where fp32 takes the sums), the one rounding of inputs
far below the row's largest, extreme magnitudes, denormals kept, non-finite rows, zero rows; and
$KVQ_CPU_GEMV, which picks it or the vdpbf16ps GEMV (both against the scalar reference)."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.formats.pack_quantized import pack_int4
from kvq.runtime.kernels.w4a16_cpu import (
    CPU_GEMV_ENV,
    bf16_gemv,
    describe_cpu_path,
    native_scale,
    resolve_cpu_isa,
    runnable_isas,
    w4a16_native,
)
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, random_w4a16

pytestmark = pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")


@pytest.fixture(autouse=True)
def _vnni_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI GEMV whatever this CPU's vendor (the default: vnni on Intel, bf16 elsewhere)."""
    monkeypatch.setenv(CPU_GEMV_ENV, "vnni")


# (N, K, group_size): whole and tail blocks of 128 inputs (K = 96, 160, 576, 4160), every group size
SHAPES = [(5, 96, 32), (9, 160, 32), (13, 576, 64), (6, 1280, 128), (4, 4160, 64)]


def _weight(num_rows: int, in_features: int, group_size: int, seed: int):
    """(packed, bf16 scale, the float64 weight q * scale)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (num_rows, in_features), generator=gen, dtype=torch.int8)
    scale = ((torch.rand(num_rows, in_features // group_size, generator=gen) + 0.5) / 64).to(torch.bfloat16)
    dense = q.double() * scale.double().repeat_interleave(group_size, dim=1)
    return pack_int4(q), scale, dense


def _gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int, isa="avx512bf16"):
    """The batch-1 GEMV's fp32 outputs `[N]` as float64."""
    return w4a16_native(x, packed, native_scale(scale), group_size, isa, out_dtype=torch.float32)[0].double()


def _fp32_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What fp32 may lose taking the exact lane sums: a rounding per block, per FMA and per horizontal add,
    each at most 2^-24 of the sum of the terms' magnitudes (x2 margin)."""
    steps = x.shape[-1] / 128 + 8
    return 2 * steps * 2.0**-24 * (dense.abs() @ x[0].double().abs())


@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_sums_are_exact_within_fp32_rounding(out_features: int, in_features: int, group_size: int) -> None:
    """Inputs within 2^-15 of the row's largest are exact as fixed point: only fp32's sums differ from the
    float64 dot products, well inside a bound that a product rounded per term would exceed."""
    packed, scale, dense = _weight(out_features, in_features, group_size, in_features)
    gen = torch.Generator().manual_seed(1)
    exponents = torch.randint(-12, 3, (1, in_features), generator=gen).float()  # a 2^14 range
    x = (torch.randn(1, in_features, generator=gen) * 2.0**exponents).to(torch.bfloat16)
    y = _gemv(x, packed, scale, group_size)
    exact = dense @ x[0].double()
    assert ((y - exact).abs() <= _fp32_bound(x, dense)).all(), (y - exact).abs().max()


def test_inputs_far_below_the_largest_round_to_its_fixed_point_grid() -> None:
    """A row whose largest is 2^10 (its grid 2^(11 - 22)) holding inputs of ~2^-14: each is rounded to a
    multiple of 2^-11 (to nearest, ties even), which is what the kernel computes with."""
    packed, scale, dense = _weight(8, 256, 128, 7)
    gen = torch.Generator().manual_seed(2)
    x = (torch.rand(1, 256, generator=gen) * 2.0**-13).to(torch.bfloat16)  # most below one grid step
    x[0, 3] = 2.0**10
    grid = 2.0**-11
    fixed = torch.round(x[0].double() / grid) * grid  # torch.round: half to even, as vcvtps2dq
    y = _gemv(x, packed, scale, 128)
    assert ((y - dense @ fixed).abs() <= _fp32_bound(x, dense)).all()
    assert not torch.allclose(y, dense @ x[0].double(), rtol=0, atol=1e-9)  # the rounding is visible


@pytest.mark.parametrize("magnitude", [2.0**-110, 2.0**-60, 2.0**60, 2.0**100])
def test_extreme_magnitudes(magnitude: float) -> None:
    """The fixed point's scale is applied in two exact halves: no overflow or flush at either end."""
    packed, scale, dense = _weight(7, 576, 64, 3)
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 576, generator=gen) * magnitude).to(torch.bfloat16)
    y, exact = _gemv(x, packed, scale, 64), dense @ x[0].double()
    assert ((y - exact).abs() <= _fp32_bound(x, dense)).all()
    assert exact.abs().max() > 0 and y.abs().max() > 0


def test_denormal_inputs_are_kept() -> None:
    packed, scale, dense = _weight(4, 64, 32, 4)
    x = torch.full((1, 64), 1e-39).to(torch.bfloat16)  # denormal in bf16
    x[0, ::3] = -3e-40
    y, exact = _gemv(x, packed, scale, 32), dense @ x[0].double()
    assert exact.abs().min() > 0
    assert ((y - exact).abs() <= _fp32_bound(x, dense)).all()


@pytest.mark.parametrize("special", [float("inf"), float("-inf"), float("nan")])
def test_a_row_holding_inf_or_nan_gives_nan(special: float) -> None:
    packed, scale, _ = _weight(6, 256, 64, 5)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert torch.isfinite(_gemv(x, packed, scale, 64)).all()
    x[0, 200] = special
    assert torch.isnan(_gemv(x, packed, scale, 64)).all()


def test_a_zero_row_gives_zeros() -> None:
    packed, scale, _ = _weight(5, 160, 32, 8)
    y = _gemv(torch.zeros(1, 160, dtype=torch.bfloat16), packed, scale, 32)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.skipif("amx" not in runnable_isas(), reason="no amx path here")
def test_amx_runs_the_same_gemv_at_batch_1() -> None:
    packed, scale, _ = _weight(9, 576, 64, 9)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert torch.equal(_gemv(x, packed, scale, 64, "amx"), _gemv(x, packed, scale, 64))


@pytest.mark.parametrize("gemv", ["vnni", "bf16"])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_both_gemvs_match_the_scalar_reference(
    monkeypatch: pytest.MonkeyPatch, gemv: str, out_features: int, in_features: int, group_size: int
) -> None:
    monkeypatch.setenv(CPU_GEMV_ENV, gemv)
    gen = torch.Generator().manual_seed(in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    for scale_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, in_features, generator=gen).to(torch.bfloat16)
        y = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "avx512bf16", torch.float32)
        expected = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "scalar", torch.float32)
        assert_close_rel(y, expected, REL_TOL[torch.float32])
        bf16_out = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "avx512bf16")
        assert torch.equal(bf16_out, y.to(torch.bfloat16))  # rounded once


def test_the_gemv_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: vnni on Intel CPUs, bf16 on others; the choice shows in the CPU path line; another value is
    a KvqError naming the variable when the path is resolved."""
    monkeypatch.delenv(CPU_GEMV_ENV)
    is_intel = "GenuineIntel" in open("/proc/cpuinfo").read()
    assert bf16_gemv() == ("vnni" if is_intel else "bf16")
    monkeypatch.setenv(CPU_GEMV_ENV, "bf16")
    assert bf16_gemv() == "bf16"
    assert "(batch 1 on vdpbf16ps)" in describe_cpu_path("avx512bf16")
    monkeypatch.setenv(CPU_GEMV_ENV, "vnni")
    assert "(batch 1 on AVX-512 VNNI integer sums)" in describe_cpu_path("avx512bf16")
    monkeypatch.setenv(CPU_GEMV_ENV, "int8")
    with pytest.raises(KvqError, match=r"\$KVQ_CPU_GEMV is 'int8'; expected vnni, bf16 or unset"):
        resolve_cpu_isa("avx512bf16")
    with pytest.raises(KvqError, match="KVQ_CPU_GEMV"):
        resolve_cpu_isa("auto")
    assert resolve_cpu_isa("avx512") == "avx512"  # a path without the GEMV does not ask
