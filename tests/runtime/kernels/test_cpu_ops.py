"""kvq's C ops for the small ops of a CPU decode step (`kernels/cpu_ops.py`) against the torch ops they
replace: RMSNorm (with and without the fused residual add), SiLU-and-mul, rotary, the KV store (bf16 and
FP8 pages, every bf16 value) and the greedy argmax, on odd widths and row counts; and the switch that
turns them off (the torch path) or away (non-bf16, non-contiguous), each through a `CpuOps` as an engine
chooses it. The decode attention's tests are
in test_cpu_attention.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels.cpu import ops as cpu_ops
from kvq.runtime.kernels.cpu.ops import WIDEST, CpuOps, argmax_finite
from kvq.runtime.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(cpu_ops._ext is None, reason="kvq's CPU extension is not built")
OPS = CpuOps.choose("auto")  # the widest level this CPU runs
SHAPES = [(1, 576), (7, 577), (64, 1024), (3, 5), (33, 1536)]  # (rows, width): widths off the 16 lanes


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def silu_mul_c(ops: CpuOps, gate_up: torch.Tensor) -> torch.Tensor:
    """The C SiLU-and-mul at any size (`CpuOps.silu_and_mul` hands large ones to torch)."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    fn, args = ops.silu_mul_call(gate_up, out)
    fn(*args)
    return out


def vector_level_runs() -> list[str]:
    """The CPU paths that hold the C ops to each vector level this CPU runs: `scalar` (the baseline)
    first, then `avx2` where it runs, then `auto` (the widest)."""
    from kvq.runtime.kernels.cpu.isa import runnable_isas

    return ["scalar"] + [isa for isa in ("avx2", "auto") if isa == "auto" or isa in runnable_isas()]


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps between two same-sign-ish bf16 tensors (as int16 bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_rms_norm_equals_torch(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, width, generator=gen).bfloat16()
    weight = (torch.rand(width, generator=gen) * 2).bfloat16()
    out, same = OPS.rms_norm(x, weight, 1e-5)
    expected = F.rms_norm(x, (width,), weight, 1e-5)
    assert same is x
    # the fp32 sum of squares is added in another order than torch's: at most one bf16 step, rarely
    assert int(_bf16_ulps(out, expected).max()) <= 1
    assert int((out != expected).sum()) <= max(2, out.numel() // 1000)
    out, total = OPS.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(total, x + residual)  # torch's bf16 add, bit for bit
    assert int(_bf16_ulps(out, F.rms_norm(x + residual, (width,), weight, 1e-6)).max()) <= 1
    with torch_threads(3):  # rows over the W4A16 pool (from 8,192 elements): each row's bits unchanged
        threaded = OPS.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(threaded[0], out) and torch.equal(threaded[1], total)


def test_rounding_keeps_nan_and_inf_as_torch_does() -> None:
    """bf16 rounding in the C ops is a select, not a branch (so their loops vectorize): NaN stays a quiet
    NaN and infinities stay infinite wherever torch's ops give them, in every lane of a vector."""
    x = torch.randn(4, 40).bfloat16()
    x[0, 3], x[1, 17], x[2, 33] = float("nan"), float("inf"), float("-inf")
    residual = torch.zeros_like(x)
    residual[3, 20] = float("nan")
    weight = torch.ones(40).bfloat16()
    out, total = OPS.rms_norm(x, weight, 1e-6, residual)
    expected_total = x + residual
    assert torch.equal(total.isnan(), expected_total.isnan())
    assert torch.equal(total[~total.isnan()], expected_total[~expected_total.isnan()])
    assert torch.equal(out.isnan(), F.rms_norm(expected_total, (40,), weight, 1e-6).isnan())
    gate_up = torch.randn(3, 64).bfloat16()
    gate_up[0, 5], gate_up[1, 40], gate_up[2, 7] = float("nan"), float("inf"), float("inf")
    gate, up = gate_up.chunk(2, dim=-1)
    out, expected = silu_mul_c(OPS, gate_up), F.silu(gate) * up
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize(("rows", "width"), SHAPES)
def test_silu_mul_equals_torch(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul_c(OPS, gate_up)
    expected = F.silu(gate) * up
    assert out.shape == (rows, width)
    assert int(_bf16_ulps(out, expected).max()) <= 1  # expf vs torch's vectorized exp: rarely a step
    assert int((out != expected).sum()) <= max(2, out.numel() // 1000)
    with torch_threads(3):
        assert torch.equal(silu_mul_c(OPS, gate_up), out)


def test_which_tensors_take_the_c_ops() -> None:
    x = torch.randn(4, 64).bfloat16()
    assert OPS.applies(x)
    assert not OPS.applies(x.float())  # fp32 (the reference mode) stays in torch
    assert not OPS.applies(x.t())  # not contiguous
    assert OPS.silu_mul_applies(torch.zeros(2, 2 * 1536).bfloat16())  # a decode step's few rows: C
    assert not OPS.silu_mul_applies(torch.zeros(32, 2 * 1536).bfloat16())  # a batch: torch's vectorized exp
    off = CpuOps.choose("torch")
    assert off.level is None and not off.applies(x) and off.describe_level() == "torch"
    norm = RMSNorm(torch.ones(64).bfloat16(), 1e-5, off)
    assert norm.ops is None and off.on(torch.device("cpu")) is None and OPS.on(torch.device("meta")) is None
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))  # the torch op itself
    normed, total = norm.add_norm(x, x)
    assert torch.equal(total, x + x) and torch.equal(normed, F.rms_norm(x + x, (64,), norm.weight, 1e-5))


@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 151_937])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(vocab: int, dtype: torch.dtype) -> None:
    """The sampler's argmax in C gives torch.argmax's index on fp32 and bf16 rows with ties (the first maximum
    wins), with +-inf, with NaN (the first NaN), all -inf, and on widths off the 16 lanes, and flags the
    rows holding a NaN or +-inf; non-contiguous rows go to torch itself."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(10, vocab, generator=gen)
    x[1] = x[1].round()  # many ties
    x[1, -1] = x[1].max() + 1 if vocab > 1 else x[1, -1]
    x[2, vocab // 2] = float("inf")
    x[3] = float("-inf")
    x[4, vocab // 3] = float("nan")
    x[4, -1] = float("nan")
    x[5, :] = 0.0  # all tied: index 0
    x[6, vocab - 1] = 1e30  # the maximum in the tail past the 16-lane blocks
    x[7, 0] = float("-inf")
    x[8] = x[8].abs().neg()  # all negative
    x[9] = 3e38  # finite, though their sum is not
    x = x.to(dtype)
    expected = (x.argmax(dim=-1), x.isfinite().all(dim=-1))
    assert expected[1].tolist() == [True, True, False, False, False, True, True, False, True, True]
    for got in (argmax_finite(x), argmax_finite(x.t().contiguous().t())):  # the second: torch's own
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with torch_threads(3):
        got = argmax_finite(x)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert argmax_finite(x[:0])[0].shape == (0,)


@pytest.mark.parametrize(("num_tokens", "rotary_dim"), [(1, 64), (5, 64), (3, 32)])  # 32: partial (GLM)
def test_rotary_equals_torch(num_tokens: int, rotary_dim: int) -> None:
    from transformers import LlamaConfig

    from kvq.runtime.layers.rotary import RotaryEmbedding

    config = LlamaConfig(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config.rope_parameters["partial_rotary_factor"] = rotary_dim / 64
    rotary = RotaryEmbedding(config, 64, 256, torch.bfloat16, torch.device("cpu"), OPS)
    in_torch = RotaryEmbedding(config, 64, 256, torch.bfloat16, torch.device("cpu"), CpuOps.choose("torch"))
    qkv = torch.randn(num_tokens, 13 * 64, generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
    heads = qkv[:, : 12 * 64].view(num_tokens, 12, 64)  # the q/k heads of a qkv row: a strided view
    cos_sin = rotary.at(torch.arange(num_tokens) * 17)
    assert OPS.rotary_applies(heads, *cos_sin)
    assert in_torch.ops is None  # the C ops off: the layer holds none and runs torch's
    assert torch.equal(rotary(heads, cos_sin), in_torch(heads, cos_sin))


def test_store_writes_the_bytes_torch_writes(cache_dtype: torch.dtype) -> None:
    from kvq.runtime.kernels.kv_cache_layout import FP8_E4M3_MAX, quantize_kv

    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim, page_size = 9, 3, 64, 4
    # every magnitude an FP8 page meets: subnormals, ties, past 448 (clamped), signed zeros
    values = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen) * 10.0 ** torch.randint(
        -4, 3, (num_tokens, 2 * num_kv_heads, 1), generator=gen
    )
    values[0, 0, :4] = torch.tensor([-0.0, 0.0, 2.0**-10, 3 * 2.0**-10])
    qkv = values.bfloat16().flatten(1)  # k and v: strided views of one row per token, as in attention
    k = qkv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, num_kv_heads * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    pool = torch.zeros(2, 6, page_size, num_kv_heads, head_dim, dtype=cache_dtype)
    scales = torch.tensor([[0.5, 0.01, 2.0], [1.0, 0.03, 0.25]])
    slots = torch.tensor([5, 0, -1, 7, 23, 12, 13, 2, 9], dtype=torch.int32)  # one skipped
    assert OPS.store_applies(k, v, pool[0], slots)
    OPS.store_kv(k, v, pool[0], pool[1], scales, slots)
    expected = torch.zeros_like(pool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for i, x in enumerate((k, v)):
                stored = quantize_kv(x[t], cache_dtype, scales[i][:, None])
                expected[i, slot // page_size, slot % page_size] = stored
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))
    if cache_dtype == torch.float8_e4m3fn:
        assert float(pool.float().abs().max()) == FP8_E4M3_MAX  # some values were clamped


@pytest.mark.parametrize("v_scale", [1.0, 0.37, 3e-3])
def test_store_quantizes_every_bf16_value_as_torch_does(v_scale: float) -> None:
    """FP8 pages from all 65,536 bf16 bit patterns (NaN, infinities, subnormals, every rounding tie), K at
    scale 1 and V at `v_scale`: the C op's branch-free conversion writes torch's bytes."""
    from kvq.runtime.kernels.kv_cache_layout import quantize_kv

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    k = every.view(256, 1, 256)
    v = every.flip(0).view(256, 1, 256)
    pool = torch.zeros(2, 16, 16, 1, 256, dtype=torch.float8_e4m3fn)
    scales = torch.tensor([[1.0], [v_scale]])
    OPS.store_kv(k, v, pool[0], pool[1], scales, torch.arange(256, dtype=torch.int32))
    for i, x in enumerate((k, v)):
        expected = quantize_kv(x, torch.float8_e4m3fn, scales[i][:, None])
        assert torch.equal(pool[i].view(256, 1, 256).view(torch.uint8), expected.view(torch.uint8))


def test_every_vector_level_gives_the_same_bits() -> None:
    """RMSNorm (with the residual), SiLU-and-mul, rotary, the FP8 store and the argmax built for the
    baseline, AVX2 and AVX-512 (the scalar / avx2 / auto paths hold the level) give the same bits, on
    widths off the vector steps."""
    runs = vector_level_runs()
    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(2, 33, 577, generator=gen) * 3).bfloat16()
    weight = torch.rand(577, generator=gen).bfloat16()
    gate_up = (torch.randn(5, 2 * 1539, generator=gen) * 4).bfloat16()
    heads = torch.randn(3, 13 * 72, generator=gen).bfloat16()[:, : 12 * 72].view(3, 12, 72)
    cos, sin_signed = torch.randn(2, 3, 1, 72, generator=gen).bfloat16()
    kv = (torch.randn(4, 6, 72, generator=gen) * 30).bfloat16()
    slots, scales = torch.tensor([3, 0, 9, 14]), torch.rand(2, 3, generator=gen) + 0.05
    logits = torch.randn(7, 1000, generator=gen)
    outs: dict[str, list[torch.Tensor]] = {}
    for isa in runs:
        ops = CpuOps.choose(isa)
        assert ops.level is not None
        pool = torch.zeros(2, 4, 4, 3, 72, dtype=torch.float8_e4m3fn)
        ops.store_kv(kv[:, :3], kv[:, 3:], pool[0], pool[1], scales, slots)
        outs[isa] = [
            *ops.rms_norm(x, weight, 1e-5, residual),
            silu_mul_c(ops, gate_up),
            ops.rotary(heads, cos, sin_signed, 64),
            pool.view(torch.uint8),
            *argmax_finite(logits, ops.level),
            *argmax_finite(logits.bfloat16(), ops.level),
        ]
    assert OPS.level == WIDEST  # auto: the widest (the C side lowers it to what this CPU runs)
    for isa in runs[1:]:
        for got, want in zip(outs[isa], outs["scalar"], strict=True):
            assert torch.equal(got, want), isa
