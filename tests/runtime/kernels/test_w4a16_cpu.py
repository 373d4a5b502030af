"""kvq's native CPU W4A16 kernel: every SIMD path against the scalar C reference and `w4a16_reference`
(irregular shapes, group sizes 32/64/128, batch 1..64 and beyond), the output rounding, threads, fork,
and the KVQ_CPU_ISA choice with its errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.kernels import fused_moe_reference, fused_moe_w4a16, prepare_w4a16, w4a16_linear
from kvq.runtime.kernels.cpu.isa import (
    CPU_DOT_ENV,
    CPU_ISA_ENV,
    DENSE_CHUNK_ELEMENTS,
    DENSE_FROM_ROWS,
    VDPBF16PS_DENSE_FROM_ROWS,
    bf16_dot,
    resolve_cpu_isa,
    runnable_isas,
)
from kvq.runtime.kernels.cpu.linear import (
    DenseScratch,
    NativeW4A16,
    dense_from_rows,
    dequantize,
    native_scale,
    w4a16_native,
)
from kvq.runtime.kernels.w4a16 import w4a16_reference
from tests.runtime.cpu_isa import SIMD_ISAS, needs_native
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, bf16_weight, random_w4a16

# (N, K, group_size): N not a multiple of the 4-row tile, K with partial SIMD blocks (K/8 words not a
# multiple of 8 or 16 lanes) and several dequantized tiles (K > 512 / 1024)
SHAPES = [
    (1, 32, 32),
    (7, 96, 32),
    (13, 576, 64),
    (33, 1056, 32),
    (200, 384, 128),
    (66, 1536, 128),
    (5, 4160, 64),
]
BATCHES = [1, 2, 3, 8, 17, 64]
GEMM_SHAPES = [*SHAPES, (9, 352, 32), (6, 1280, 128)]  # and K % 128 = 96, a whole number of blocks


def _native(isa: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int, **kw):
    return w4a16_native(x, packed, native_scale(scale), group_size, isa, **kw)


@needs_native
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_scalar_reference_is_the_spec(out_features: int, in_features: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    x = torch.randn(3, in_features, generator=gen)
    y = _native("scalar", x, packed, scale, group_size)
    assert_close_rel(y, w4a16_reference(x, packed, scale, group_size), REL_TOL[torch.float32])


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("num_rows", BATCHES)
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_simd_matches_scalar_reference(
    isa: str, num_rows: int, out_features: int, in_features: int, group_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_rows * 1000 + in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    x = torch.randn(num_rows, in_features, generator=gen).to(torch.bfloat16)
    y = _native(isa, x, packed, scale, group_size, out_dtype=torch.float32)
    assert_close_rel(y, _expected(isa, x, packed, scale, group_size), REL_TOL[torch.float32])
    assert torch.equal(_native(isa, x, packed, scale, group_size), y.to(torch.bfloat16))  # rounded once


def _expected(isa: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int):
    """What path `isa` computes for bf16 x, in fp32: the scalar reference's sums of exact q * scale, or for
    avx512bf16's vdpbf16ps GEMM (2 rows and more where `bf16_dot()` is "bf16") x @ bf16(q * scale)^T."""
    if isa == "avx512bf16" and x.shape[0] >= 2 and bf16_dot() == "bf16":
        return x.float() @ bf16_weight(packed, scale, group_size).float().T
    return _native("scalar", x, packed, scale, group_size, out_dtype=torch.float32)


@pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")
@pytest.mark.parametrize("num_rows", [2, 3, 4, 5, 8, 70])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), GEMM_SHAPES)
def test_avx512bf16_gemm_on_vdpbf16ps_is_x_times_the_bf16_weight(
    monkeypatch: pytest.MonkeyPatch, num_rows: int, out_features: int, in_features: int, group_size: int
) -> None:
    """$KVQ_CPU_DOT=bf16 (other vendors' default) at 2 rows and more: compressed-tensors' bf16 weight, fp32
    sums, on every tail of the 4 x 4 register tile (weight rows, activation rows) and of the blocks of 128
    inputs (K = 96, 352, 1056, 4160: a block's groups past K), fp32 scales bf16 cannot hold."""
    monkeypatch.setenv(CPU_DOT_ENV, "bf16")
    gen = torch.Generator().manual_seed(num_rows * 100 + in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    scale = native_scale(scale.float() * (1 + 2**-12))
    weight = bf16_weight(packed, scale, group_size).float()
    x = torch.randn(num_rows, in_features, generator=gen).to(torch.bfloat16)
    y = _native("avx512bf16", x, packed, scale, group_size, out_dtype=torch.float32)
    assert_close_rel(y, x.float() @ weight.T, REL_TOL[torch.float32])
    exact = w4a16_reference(x, packed, scale, group_size)  # the weight's rounding, and no more
    assert_close_rel(y, exact, REL_TOL[torch.bfloat16])


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_simd_dtypes(isa: str, x_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    packed, scale = random_w4a16(37, 352, 32, gen)
    scale = scale.to(scale_dtype)
    for num_rows in (1, 5):
        x = torch.randn(num_rows, 352, generator=gen).to(x_dtype)
        y = _native(isa, x, packed, scale, 32)
        assert y.dtype == x_dtype
        exact = w4a16_reference(x, packed, scale, 32)
        assert torch.equal(y, _native(isa, x, packed, scale, 32, out_dtype=torch.float32).to(x_dtype))
        assert_close_rel(y, exact, REL_TOL[x_dtype])


@pytest.mark.parametrize("isa", [*SIMD_ISAS, pytest.param("scalar", marks=needs_native)])
def test_threads_do_not_change_results(isa: str) -> None:
    gen = torch.Generator().manual_seed(8)
    packed, scale = random_w4a16(301, 640, 64, gen)
    xs = [torch.randn(m, 640, generator=gen).to(torch.bfloat16) for m in (1, 4, 130)]  # 130: two passes
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append([_native(isa, x, packed, scale, 64, out_dtype=torch.float32) for x in xs])
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@needs_native
def test_kernel_runs_in_a_forked_child() -> None:
    gen = torch.Generator().manual_seed(9)
    packed, scale = random_w4a16(96, 256, 32, gen)
    x = torch.randn(2, 256, generator=gen)
    isa = "avx2" if "avx2" in runnable_isas() else "scalar"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = _native(isa, x, packed, scale, 32, out_dtype=torch.float32)  # workers started
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's workers are gone, the kernel must start its own
            y = _native(isa, x, packed, scale, 32, out_dtype=torch.float32)
            os.write(write_end, y.numpy().tobytes())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(before)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).view(2, 96), expected)


def test_empty_batch(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(10)
    w = prepare_w4a16(*random_w4a16(24, 64, 32, gen), 32, backend="torch")
    assert w4a16_linear(torch.zeros(0, 64, dtype=torch.bfloat16), w).shape == (0, 24)


def test_fused_moe_runs_on_each_cpu_path(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(11)
    w13_packed, w13_scale = random_w4a16(2 * 96, 160, 32, gen, num_experts=5)
    w2_packed, w2_scale = random_w4a16(160, 96, 32, gen, num_experts=5)
    x = torch.randn(6, 160, generator=gen).to(torch.bfloat16)
    topk_ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(6)])
    topk_weights = torch.rand(6, 2, generator=gen)
    w13 = prepare_w4a16(w13_packed, w13_scale, 32, backend="torch")
    w2 = prepare_w4a16(w2_packed, w2_scale, 32, backend="torch")
    assert w13.cpu_isa == (None if cpu_isa == "torch" else cpu_isa)
    y = fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)
    expected = fused_moe_reference(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, 32)
    assert_close_rel(y, expected, REL_TOL[torch.bfloat16])


def test_isa_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_ISA_ENV, raising=False)
    runnable = runnable_isas()
    expected = next((isa for isa in ("amx", "avx512bf16", "avx512", "avx2") if isa in runnable), "torch")
    assert resolve_cpu_isa() == expected
    monkeypatch.setenv(CPU_ISA_ENV, " Torch ")
    assert resolve_cpu_isa() == "torch"
    assert resolve_cpu_isa("auto") == expected  # an argument beats the environment
    monkeypatch.setenv(CPU_ISA_ENV, "sse2")
    expected_choices = r"KVQ_CPU_ISA is 'sse2'; expected one of auto, amx, avx512bf16, avx512, avx2, scalar"
    with pytest.raises(KvqError, match=expected_choices):
        resolve_cpu_isa()
    for isa in ("amx", "avx512bf16", "avx512", "avx2", "scalar"):
        if isa not in runnable:
            monkeypatch.setenv(CPU_ISA_ENV, isa)
            with pytest.raises(KvqError, match=f"is '{isa}' but .* pick one of auto"):
                resolve_cpu_isa()


def test_without_the_extension_auto_is_the_torch_op() -> None:
    code = (
        "import sys; sys.modules['kvq.runtime.kernels.cpu._linear'] = None\n"
        "import os, torch\n"
        "from kvq.errors import KvqError\n"
        "from kvq.runtime.kernels import prepare_w4a16\n"
        "from kvq.runtime.kernels.cpu.isa import resolve_cpu_isa, runnable_isas\n"
        "assert runnable_isas() == () and resolve_cpu_isa('auto') == 'torch'\n"
        "w = prepare_w4a16(torch.zeros(16, 4, dtype=torch.int32), torch.ones(16, 1), 32)\n"
        "assert w.layout == 'int4pack-cpu', w.layout\n"
        "try:\n"
        "    resolve_cpu_isa('avx2')\n"
        "except KvqError as e:\n"
        "    assert 'not built' in str(e) and '--cpu-isa torch' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env_code = f"import os; os.environ.pop('{CPU_ISA_ENV}', None)\n" + code
    subprocess.run([sys.executable, "-c", env_code], check=True)


def test_strided_and_leading_dims(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(12)
    packed, scale = random_w4a16(40, 128, 64, gen)
    w = prepare_w4a16(packed, scale, 64, backend="torch")
    x = torch.randn(128, 6, generator=gen).to(torch.bfloat16).T  # [6, 128], not contiguous
    expected = w4a16_reference(x, packed, scale, 64)
    assert_close_rel(w4a16_linear(x, w), expected, REL_TOL[torch.bfloat16])
    y = w4a16_linear(x.reshape(2, 3, 128), w)
    assert y.shape == (2, 3, 40)
    assert_close_rel(y.reshape(6, 40), expected, REL_TOL[torch.bfloat16])


@pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")
@pytest.mark.skipif(bool(os.environ.get("KVQ_SIMDE_CHECK")), reason="SIMDe's vdpbf16ps keeps denormals")
@pytest.mark.parametrize("dot", ["vnni", "bf16"])
def test_avx512bf16_flushes_denormals_only_on_vdpbf16ps(monkeypatch, dot: str) -> None:
    """vdpbf16ps flushes denormal inputs to zero, the fp32 paths and VNNI's integer sums do not: which
    path ran, by its values (bf16 activations take what $KVQ_CPU_DOT names, at batch 1 and 2; fp32 ones
    the AVX-512 path)."""
    monkeypatch.setenv(CPU_DOT_ENV, dot)
    packed = torch.full((4, 4), -1, dtype=torch.int32)  # every nibble 15: q = 7
    scale = torch.ones(4, 1)
    tiny = torch.full((2, 32), 1e-39)  # denormal in bf16 and fp32; 32 * 7e-39 is a normal fp32
    bf16 = tiny.to(torch.bfloat16)
    for x, flushed in ((bf16, dot == "bf16"), (bf16[:1], dot == "bf16"), (tiny, False)):
        y = _native("avx512bf16", x, packed, scale, 32, out_dtype=torch.float32)
        expected = _native("avx512", x, packed, scale, 32, out_dtype=torch.float32)
        assert expected.min() > 1e-37
        assert torch.equal(y, torch.zeros_like(y) if flushed else expected), (x.dtype, x.shape[0])


@needs_native
@pytest.mark.parametrize("isa", ["scalar", "avx512bf16"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("out_features", "in_features", "group_size"), SHAPES)
def test_dequantize_is_compressed_tensors_bf16_weight(
    isa: str, scale_dtype: torch.dtype, out_features: int, in_features: int, group_size: int
) -> None:
    """bf16(q * scale), bit for bit: the weight compressed-tensors decompresses to."""
    if isa not in runnable_isas():
        pytest.skip(f"no {isa} path here")
    gen = torch.Generator().manual_seed(out_features + in_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    scale = scale.to(scale_dtype)
    out = torch.full((out_features, in_features), float("nan"), dtype=torch.bfloat16)
    dequantize(packed, native_scale(scale), group_size, isa, out)
    weight = w4a16_reference(torch.eye(in_features), packed, scale, group_size).t()  # fp32 q * scale, exact
    assert torch.equal(out, weight.bfloat16())


@pytest.mark.skipif("avx512bf16" not in runnable_isas(), reason="no avx512bf16 path here")
@pytest.mark.parametrize("chunk_elements", [DENSE_CHUNK_ELEMENTS, 1000])  # 1000: several chunks of rows
def test_prefill_batches_run_the_decompressed_weight_through_torch(monkeypatch, chunk_elements: int) -> None:
    """From `dense_from_rows` bf16 rows (DENSE_FROM_ROWS, or VDPBF16PS_DENSE_FROM_ROWS where the GEMM is the
    vdpbf16ps one), avx512bf16 runs x @ bf16(q * scale)^T in torch's BF16 GEMM: the result is that product's
    (not the W4A16 kernel's fp32 sums), for either GEMM."""
    monkeypatch.setattr("kvq.runtime.kernels.cpu.linear.DENSE_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(5)
    packed, scale = random_w4a16(200, 384, 128, gen)
    weight = w4a16_reference(torch.eye(384), packed, scale, 128).t().bfloat16()
    for dot, first in (("vnni", DENSE_FROM_ROWS), ("bf16", VDPBF16PS_DENSE_FROM_ROWS)):
        monkeypatch.setenv(CPU_DOT_ENV, dot)
        assert dense_from_rows("avx512bf16") == first
        linear = NativeW4A16(packed, native_scale(scale), 128, "avx512bf16", DenseScratch())
        for rows in (first - 1, first, 130):
            x = torch.randn(rows, 384, generator=gen).bfloat16()
            y = linear(x)
            assert y.shape == (rows, 200) and y.dtype == torch.bfloat16
            assert_close_rel(y, w4a16_reference(x, packed, scale, 128), REL_TOL[torch.bfloat16])
            if rows >= first:
                assert torch.equal(y, torch.nn.functional.linear(x, weight))
