"""kvq's C paged decode attention (`kernels/cpu_ops.py`, `_cpu_ops_attention.h`) against the reference: bf16
and FP8 pages read in place, on the W4A16 kernel's thread pool, and the same bits at every vector level
(baseline, AVX2 with F16C widening, AVX-512 with AVX-512 BW widening)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvq.runtime.kernels import PagedKVCache
from kvq.runtime.kernels.cpu import ops as cpu_ops
from kvq.runtime.kernels.cpu.isa import runnable_isas
from kvq.runtime.kernels.cpu.ops import WIDEST, CpuOps
from kvq.runtime.kernels.paged.attention import paged_decode_attention_reference
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, random_paged_kv
from tests.runtime.kernels.test_cpu_ops import OPS, torch_threads, vector_level_runs

pytestmark = pytest.mark.skipif(cpu_ops._ext is None, reason="kvq's CPU extension is not built")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_decode_attention_reads_the_pages_in_place(
    cache_dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [19, 1, 0, 16, 53]  # an empty sequence: zeros
    kv = random_paged_kv(seq_lens, 16, 3, 64, cache_dtype, True, gen)
    pool = torch.stack([kv.k_cache, kv.v_cache])  # the engine's layout: K and V halves of one tensor
    k_cache, v_cache = pool[0], pool[1]
    q = torch.randn(len(seq_lens), 9, 64, generator=gen).bfloat16()
    tables, lens = kv.block_tables.to(index_dtype), kv.seq_lens.to(index_dtype)
    assert OPS.attention_applies(q, k_cache, tables, lens)
    cache = PagedKVCache.of(k_cache, v_cache, kv.k_scale, kv.v_scale)
    scales = cache.stacked_scales
    out = OPS.decode_attention(q, k_cache, v_cache, scales, tables, lens, 0.3)
    expected = paged_decode_attention_reference(q, cache, kv.tables, 0.3)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()  # NaN in unowned slots never read
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert_close_rel(out, expected, REL_TOL[torch.bfloat16])
    # q as the model hands it over at batch > 1: a split of the rotary's [B, Hq + Hkv, D] output
    q_split = torch.cat([q, torch.randn(len(seq_lens), 3, 64, generator=gen).bfloat16()], dim=1)[:, :9]
    assert not q_split.is_contiguous() and OPS.attention_applies(q_split, k_cache, tables, lens)
    out_split = OPS.decode_attention(q_split, k_cache, v_cache, scales, tables, lens, 0.3)
    assert out_split.is_contiguous() and torch.equal(out_split, out)
    assert not OPS.attention_applies(q.transpose(1, 2), k_cache, tables, lens)  # heads not packed
    with torch_threads(3):  # the (sequence, KV head) pairs over the W4A16 kernel's pool: the same bits
        assert torch.equal(OPS.decode_attention(q, k_cache, v_cache, scales, tables, lens, 0.3), out)


_POOL_PROBE = """
import os, torch
import kvq.runtime.kernels  # the package first, as every kvq entry point imports it
from kvq.runtime.kernels.cpu import _ops as _cpu_ops
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.paged.attention import DecodeTables, paged_decode_attention_reference
from kvq.runtime.kernels.paged.kv_cache import PagedKVCache
torch.set_num_threads(3)
q = torch.randn(8, 9, 64).bfloat16()
k, v = torch.randn(2, 9, 16, 3, 64).bfloat16()
tables = torch.arange(8, dtype=torch.int32).view(8, 1)
lens = torch.full((8,), 16, dtype=torch.int32)
before = len(os.listdir("/proc/self/task"))
out = CpuOps.choose().decode_attention(q, k, v, torch.ones(2, 3), tables, lens, 0.125)
after = len(os.listdir("/proc/self/task"))
ref = paged_decode_attention_reference(q, PagedKVCache.of(k, v), DecodeTables(tables, lens), 0.125)
print(_cpu_ops.has_thread_pool(), after - before, float((out.float() - ref.float()).abs().max()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_decode_attention_runs_on_the_w4a16_pool_after_a_package_import() -> None:
    """The attention's (sequence, KV head) pairs go over the W4A16 extension's threads. Its function
    pointer is looked up while kvq.runtime.kernels is still initializing; a lookup by attribute walk
    from `kvq` failed there, and every call ran on one thread (this test, in a fresh process: the pool
    linked, its two workers started by the first call at 3 threads, the same values)."""
    if cpu_ops._ext is None or not runnable_isas():
        pytest.skip("the C extensions are not built")
    run = subprocess.run([sys.executable, "-c", _POOL_PROBE], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    linked, new_threads, max_diff = run.stdout.split()
    assert linked == "True" and int(new_threads) == 2 and float(max_diff) < 0.05


FP8_PATHS = ["scalar", "avx2", "auto"]  # arithmetic; F16C; AVX-512 BW where the CPU has it


def _fp8_path_or_skip(isa: str) -> None:
    if isa != "auto" and isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")


@pytest.mark.parametrize("isa", FP8_PATHS)
def test_decode_attention_reads_every_fp8_byte_as_torch_does(isa: str) -> None:
    """The C op turns e4m3fn bytes into fp32 exactly, in arithmetic (the scalar path) or through
    binary16 with F16C or AVX-512: all 256 of them, subnormals and NaN included, through one token's
    attention (softmax of one score is 1, so out = bf16(v * v_scale)); D = 259 puts bytes in the 32- and
    16-wide loops and in their tails."""
    _fp8_path_or_skip(isa)
    ops = CpuOps.choose(isa)
    v_bytes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v_bytes = torch.cat([v_bytes, v_bytes[[0x7F, 0x08, 0xFF]]])  # NaN, a subnormal, -NaN in the tail
    v_cache = v_bytes.view(1, 1, 1, 259).repeat(2, 16, 1, 1)
    k_cache = torch.zeros_like(v_cache)
    scales = torch.tensor([[1.0], [0.375]])
    q = torch.ones(1, 2, 259, dtype=torch.bfloat16)
    tables, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    out = ops.decode_attention(q, k_cache, v_cache, scales, tables, lens, 1.0)
    expected = (v_bytes.float() * 0.375).bfloat16()
    for head in out[0]:
        assert torch.equal(head.isnan(), expected.isnan()) and expected.isnan().sum() == 4
        assert torch.equal(head[~expected.isnan()], expected[~expected.isnan()])
        assert torch.equal(head.view(torch.int16)[expected.isnan()] < 0, torch.tensor([False, True] * 2))


def test_every_vector_level_gives_the_same_bits(cache_dtype: torch.dtype) -> None:
    """The attention's baseline, AVX2 and AVX-512 builds (and for FP8 pages the arithmetic, F16C and
    AVX-512 BW widenings) give the same bits, at head sizes on and off the 16- and 32-byte steps and with
    scales that are not powers of two; auto takes the widest this CPU has."""
    runs = vector_level_runs()
    widest = cpu_ops._ext.vector_level(WIDEST)
    assert CpuOps.choose("auto").level == WIDEST and cpu_ops._ext.vector_level(0) == 0
    if widest == 0:
        pytest.skip("this CPU has neither AVX2 + F16C nor AVX-512: only the baseline runs")
    gen = torch.Generator().manual_seed(3)
    for head_dim in (64, 72, 13, 128):
        kv = random_paged_kv([37, 5, 16], 16, 2, head_dim, cache_dtype, True, gen)
        q = torch.randn(3, 6, head_dim, generator=gen).bfloat16()
        scales = torch.rand(2, 2, generator=gen) * 3 + 0.01
        outs = {}
        for isa in runs:
            outs[isa] = CpuOps.choose(isa).decode_attention(
                q, kv.k_cache, kv.v_cache, scales, kv.block_tables, kv.seq_lens, 0.2
            )
        assert torch.isfinite(outs["auto"]).all()
        for isa in runs[1:]:
            assert torch.equal(outs["scalar"], outs[isa]), isa
