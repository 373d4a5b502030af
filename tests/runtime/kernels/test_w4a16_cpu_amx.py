"""The amx path of kvq's native CPU W4A16 kernel (_w4a16_cpu_amx.h): bf16 batches are x @ bf16(q * scale)^T
with fp32 sums (compressed-tensors' decompressed weight) on irregular shapes, every group size, bf16 and
fp32 scales, every output dtype and thread count; batch 1, small batches and other activations run
avx512bf16's code. Skipped where the CPU or the OS cannot run AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.kernels.cpu.isa import AMX_DENSE_FROM_ROWS, AMX_FROM_ROWS, DENSE_CHUNK_ELEMENTS
from kvq.runtime.kernels.cpu.linear import DenseScratch, NativeW4A16, native_scale, w4a16_native
from tests.runtime.cpu_isa import needs_amx
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, bf16_weight, random_w4a16

pytestmark = needs_amx

# (N, K, group_size): N not a multiple of the 16-row strip, K an odd number of 32-input tiles (352, 1056)
# or not a multiple of 64 / 128 inputs, K long enough for several L1s of strip (4160), one chunk of 128
# inputs or less per pair (96: a pair's results wait for their store while the next pair's tiles run)
SHAPES = [
    (1, 32, 32),
    (70, 96, 32),
    (37, 352, 32),
    (13, 576, 64),
    (33, 1056, 32),
    (200, 384, 128),
    (66, 1536, 128),
    (5, 4160, 64),
]
BATCHES = [2, 3, 16, 17, 33, 64, 100]  # tails of the 16-row activation tiles and of the pairs of them


@pytest.fixture
def amx_from_two_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The AMX GEMM for every batch of 2 rows and more (it takes them; auto runs it from AMX_FROM_ROWS)."""
    monkeypatch.setattr("kvq.runtime.kernels.cpu.linear.AMX_FROM_ROWS", 2)


@pytest.mark.usefixtures("amx_from_two_rows")
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_amx_is_x_times_thebf16_weight(
    out_features: int, in_features: int, group_size: int, scale_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(out_features * 10 + in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    scale = native_scale(scale.to(scale_dtype) * (1 + 2**-12))  # fp32: scales bf16 cannot hold
    weight = bf16_weight(packed, scale, group_size).float()
    for num_rows in BATCHES:
        x = torch.randn(num_rows, in_features, generator=gen).bfloat16()
        y = w4a16_native(x, packed, scale, group_size, "amx", out_dtype=torch.float32)
        assert_close_rel(y, x.float() @ weight.T, REL_TOL[torch.float32])
        assert torch.equal(w4a16_native(x, packed, scale, group_size, "amx"), y.bfloat16())  # rounded once
        y16 = w4a16_native(x, packed, scale, group_size, "amx", out_dtype=torch.float16)
        assert torch.equal(y16, y.half())


@pytest.mark.usefixtures("amx_from_two_rows")
def test_amx_threads_do_not_change_results() -> None:
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_w4a16(301, 640, 64, gen)
    xs = [torch.randn(m, 640, generator=gen).bfloat16() for m in (2, 40, 130)]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([w4a16_native(x, packed, scale, 64, "amx", out_dtype=torch.float32) for x in xs])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_amx_runs_tiles_for_bf16_batches_only() -> None:
    """Which code ran, by its values: with scale 1.00222 (fp32), bf16(7 * scale) = 7, so the AMX GEMM's sum
    over inputs of 31 ones and 1.0625 is 7 * 32.0625 = 224.4375 (bf16: 224), while avx512bf16's (batch 1,
    batches below AMX_FROM_ROWS) and avx512's (fp32 activations) fp32 sums of q * x take the scale as it
    is: ~224.94 (bf16: 225)."""
    packed = torch.full((20, 4), -1, dtype=torch.int32)  # every nibble 15: q = 7; N = 20, K = 32
    scale = torch.full((20, 1), 1.00222)
    linear = NativeW4A16(packed, scale, 32, "amx", DenseScratch())
    tiles, scaled = 224.4375, 224.4375 * 1.00222
    for num_rows, dtype, expected in (
        (1, torch.bfloat16, scaled),
        (AMX_FROM_ROWS - 1, torch.bfloat16, scaled),
        (AMX_FROM_ROWS, torch.bfloat16, tiles),
        (40, torch.bfloat16, tiles),
        (40, torch.float32, scaled),
    ):
        x = torch.ones(num_rows, 32, dtype=dtype)
        x[:, 0] = 1.0625
        y = w4a16_native(x, packed, scale, 32, "amx", out_dtype=torch.float32)
        assert_close_rel(y, torch.full((num_rows, 20), expected), REL_TOL[torch.float32])
        assert torch.equal(y.bfloat16(), torch.full((num_rows, 20), expected).bfloat16())  # 224 vs 225
        assert torch.equal(linear(x), y.to(dtype)), (num_rows, dtype)


def _bf16_bits(y: torch.Tensor) -> torch.Tensor:
    """fp32 y rounded to bf16 as the kernel's f32_to_bf16 rounds: to nearest even, a NaN made quiet with its
    sign and payload kept (torch's .bfloat16() makes every NaN 0x7FC0), as int64 bit patterns."""
    u = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(torch.isnan(y), (u >> 16) | 0x40, (u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@pytest.mark.usefixtures("amx_from_two_rows")
@pytest.mark.parametrize("num_rows", [5, 32, 40])
def test_amx_bf16_output_rounds_every_sum_as_f32_to_bf16(num_rows: int) -> None:
    """The bf16 output of the AMX GEMM (vcvtne2ps2bf16 on its fp32 sums, which flushes a denormal) has the
    bits of its fp32 output rounded as f32_to_bf16 rounds, on sums that underflow (tdpbf16ps flushes them:
    never a denormal to round), overflow, and come from NaN and infinite activations."""
    gen = torch.Generator().manual_seed(num_rows)
    packed, scale = random_w4a16(70, 128, 64, gen)
    magnitudes = ((1.0, 1.0), (2.0**-66, 2.0**-64), (2.0**-60, 2.0**-64), (2.0**100, 2.0**100))
    for weight_scale, x_scale in magnitudes:
        x = (torch.randn(num_rows, 128, generator=gen) * x_scale).bfloat16()
        x[num_rows // 2, 5], x[-1, 9] = float("nan"), float("inf")
        x[0, 1], x[0, 2] = float("inf"), -float("inf")
        tiny = native_scale((scale * weight_scale).bfloat16())
        y = w4a16_native(x, packed, tiny, 64, "amx", out_dtype=torch.float32)
        assert not ((y != 0) & (y.abs() < 2.0**-126)).any()  # no denormal sum
        got = w4a16_native(x, packed, tiny, 64, "amx").view(torch.int16).to(torch.int64) & 0xFFFF
        assert torch.equal(got, _bf16_bits(y)), weight_scale


@pytest.mark.parametrize("chunk_elements", [DENSE_CHUNK_ELEMENTS, 1000])  # 1000: several chunks of rows
def test_amx_prefill_batches(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """On amx, bf16 batches run the AMX GEMM up to AMX_DENSE_FROM_ROWS rows and dense_matmul (torch's BF16
    GEMM over the decompressed weight) from there: both the bf16-weight product, the latter F.linear's
    bits."""
    monkeypatch.setattr("kvq.runtime.kernels.cpu.linear.DENSE_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(5)
    packed, scale = random_w4a16(200, 384, 128, gen)
    linear = NativeW4A16(packed, native_scale(scale), 128, "amx", DenseScratch())
    weight = bf16_weight(packed, scale, 128)
    for num_rows in (64, AMX_DENSE_FROM_ROWS - 1, AMX_DENSE_FROM_ROWS, 300):
        x = torch.randn(num_rows, 384, generator=gen).bfloat16()
        y = linear(x)
        assert y.shape == (num_rows, 200) and y.dtype == torch.bfloat16
        assert_close_rel(y, x.float() @ weight.float().T, REL_TOL[torch.bfloat16])
        if num_rows >= AMX_DENSE_FROM_ROWS:
            assert torch.equal(y, torch.nn.functional.linear(x, weight))
        else:
            assert torch.equal(y, w4a16_native(x, packed, native_scale(scale), 128, "amx"))
