"""The avx512bf16 (and amx below AMX_FROM_ROWS) path's bf16 activations on integer dot products
(`_w4a16_cpu_vnni.h`: the GEMV and the GEMM), against float64 sums: exact integer lane sums (error only
where fp32 takes the sums), the one rounding of inputs far below a row's largest, extreme magnitudes,
denormals kept, non-finite rows (only theirs), zero rows; and $KVQ_CPU_DOT, which picks them or the
vdpbf16ps kernels (against the scalar reference, the vdpbf16ps GEMM against the bf16 weight's)."""

from __future__ import annotations

import pytest
import torch

from kvq.errors import KvqError
from kvq.formats.pack_quantized import pack_int4
from kvq.runtime.kernels.cpu.isa import CPU_DOT_ENV, bf16_dot, resolve_cpu_isa, runnable_isas
from kvq.runtime.kernels.cpu.linear import native_scale, w4a16_native
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.cpu.path import describe_cpu_path
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, bf16_weight, random_w4a16

pytestmark = pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")


@pytest.fixture(autouse=True)
def _vnni_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The VNNI kernels whatever this CPU's vendor (the default: vnni on Intel, bf16 elsewhere)."""
    monkeypatch.setenv(CPU_DOT_ENV, "vnni")


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
    """The fp32 outputs of one row x `[1, K]` (`[N]`: the GEMV) or of more (`[M, N]`: the GEMM), float64."""
    y = w4a16_native(x, packed, native_scale(scale), group_size, isa, out_dtype=torch.float32).double()
    return y[0] if x.shape[0] == 1 else y


def _fp32_bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What fp32 may lose taking the exact lane sums of row x (`[K]`): a rounding per block, per FMA and
    per horizontal add, each at most 2^-24 of the sum of the terms' magnitudes (x2 margin)."""
    steps = x.shape[-1] / 128 + 8
    return 2 * steps * 2.0**-24 * (dense.abs() @ x.reshape(-1).double().abs())


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


@pytest.mark.parametrize("dot", ["vnni", "bf16"])
@pytest.mark.parametrize("num_rows", [1, 2, 5, 70])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_both_kernels_match_the_scalar_reference(
    monkeypatch: pytest.MonkeyPatch,
    dot: str,
    num_rows: int,
    out_features: int,
    in_features: int,
    group_size: int,
) -> None:
    """The GEMV (1 row) and the GEMM (2 and more; 70: two passes of 64 activation rows) of either kind; the
    vdpbf16ps GEMM multiplies the bf16 weight bf16(q * scale)."""
    monkeypatch.setenv(CPU_DOT_ENV, dot)
    gen = torch.Generator().manual_seed(in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    for scale_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(num_rows, in_features, generator=gen).to(torch.bfloat16)
        y = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "avx512bf16", torch.float32)
        if dot == "bf16" and num_rows > 1:
            expected = x.float() @ bf16_weight(packed, scale.to(scale_dtype), group_size).float().T
        else:
            expected = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "scalar", torch.float32)
        assert_close_rel(y, expected, REL_TOL[torch.float32])
        bf16_out = w4a16_native(x, packed, scale.to(scale_dtype), group_size, "avx512bf16")
        assert torch.equal(bf16_out, y.to(torch.bfloat16))  # rounded once


def test_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: vnni on Intel CPUs, bf16 on others; the choice shows in the CPU path line; another value is
    a KvqError naming the variable when the path is resolved."""
    monkeypatch.delenv(CPU_DOT_ENV)
    is_intel = "GenuineIntel" in open("/proc/cpuinfo").read()
    assert bf16_dot() == ("vnni" if is_intel else "bf16")
    monkeypatch.setenv(CPU_DOT_ENV, "bf16")
    assert bf16_dot() == "bf16"
    assert "(bf16 activations on vdpbf16ps)" in describe_cpu_path(CpuOps.choose("avx512bf16"))
    monkeypatch.setenv(CPU_DOT_ENV, "vnni")
    assert "(bf16 activations on AVX-512 VNNI integer sums)" in describe_cpu_path(CpuOps.choose("avx512bf16"))
    monkeypatch.setenv(CPU_DOT_ENV, "int8")
    with pytest.raises(KvqError, match=r"\$KVQ_CPU_DOT is 'int8'; expected vnni, bf16 or unset"):
        resolve_cpu_isa("avx512bf16")
    with pytest.raises(KvqError, match="KVQ_CPU_DOT"):
        resolve_cpu_isa("auto")
    assert resolve_cpu_isa("avx512") == "avx512"  # a path without them does not ask


@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_gemm_rows_are_exact_within_fp32_rounding_each_on_its_own_grid(
    out_features: int, in_features: int, group_size: int
) -> None:
    """Batches: every activation row has its own fixed point (rows 2^40 apart), a zero row gives zeros, a
    row holding inf gives NaN and leaves the other rows alone."""
    packed, scale, dense = _weight(out_features, in_features, group_size, in_features + 1)
    gen = torch.Generator().manual_seed(5)
    x = (
        torch.randn(6, in_features, generator=gen)
        * torch.tensor([1.0, 2.0**-20, 2.0**20, 0.0, 1.0, 3.0])[:, None]
    )
    x = x.to(torch.bfloat16)
    x[4, 1] = float("inf")
    y = _gemv(x, packed, scale, group_size)
    for m in (0, 1, 2, 5):
        exact = dense @ x[m].double()
        assert ((y[m] - exact).abs() <= _fp32_bound(x[m], dense)).all(), m
    assert torch.equal(y[3], torch.zeros_like(y[3]))
    assert torch.isnan(y[4]).all()
