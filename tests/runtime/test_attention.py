"""The attention layer over the engine's KV pool, fed the batches `ModelRunner.prepare` builds: each step
stores its new K/V in their page slots before attending; prefill reads a cached prefix back from its
pages; decode reads only the slots a sequence owns (NaN everywhere else). BF16 and FP8 pages, bf16 and
fp32 activations. Oracle: dense causal attention over the K/V as the spec quantizes them. The kernels'
own tests (tests/runtime/kernels) cover their math on irregular shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels import CpuOps, store_kv_reference
from kvq.runtime.kernels.kv_cache_layout import dequantize_kv, quantize_kv
from kvq.runtime.kv_layout import GqaLayout
from kvq.runtime.kv_pool import KVPool
from kvq.runtime.layers.attention import PagedAttention
from kvq.runtime.model_runner import StepBatches
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel

HQ, HKV, D, PAGE, NUM_PAGES = 6, 2, 64, 4, 12
K_SCALE, V_SCALE = torch.tensor([0.02, 0.05]), torch.tensor([0.03, 0.01])  # per head (FP8 pages only)
CPU = torch.device("cpu")


def bound_layer(cache_dtype: torch.dtype) -> tuple[KVPool, PagedAttention]:
    """A one-layer pool, NaN in every page but the zero page, bound to a layer as the engine binds it."""
    pool = KVPool(GqaLayout(HKV, D, cache_dtype), 1, NUM_PAGES, PAGE, CPU)
    pool.storage[:, :, : pool.zero_page] = float("nan")
    layer = PagedAttention(HQ, HKV, D, CpuOps.choose())
    scales = [{"k_scale": K_SCALE, "v_scale": V_SCALE}]
    layer.bind(pool.layer_caches(scales, require_kv_scales=True, where="test")[0])
    return pool, layer


def held(values: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """K or V `[L, Hkv, D]` as pages of `cache_dtype` hold them, read back as fp32 (the spec's round trip)."""
    return dequantize_kv(quantize_kv(values, cache_dtype, scale[:, None]), scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q `[L_q, Hq, D]` as the last L_q tokens of k, v `[L, Hkv, D]`: `[L_q, Hq, D]` fp32."""
    num_queries, context_len = q.shape[0], k.shape[0]
    mask = torch.ones(context_len, context_len, dtype=torch.bool).tril()[context_len - num_queries :]
    k, v = (t.float().repeat_interleave(HQ // HKV, 1).transpose(0, 1) for t in (k, v))  # [Hq, L, D]
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, mask).transpose(0, 1)


def run_step(
    layer: PagedAttention,
    batch: ForwardBatch,
    kv: list[torch.Tensor],
    starts: list[int],
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, layer output) of one step whose new tokens are `kv[b][starts[b]:]` of each sequence b."""
    lengths = batch.context_lens_list
    new = torch.cat(
        [kv_b[start:n] for kv_b, start, n in zip(kv, starts, lengths, strict=True)]
    )  # [T, 2, Hkv, D]
    q = torch.randn(new.shape[0], HQ, D, generator=gen).to(new.dtype)  # [T, Hq, D]
    return q, layer(q, new[:, 0], new[:, 1], batch)


def assert_causal(
    q: torch.Tensor,
    out: torch.Tensor,
    kv: list[torch.Tensor],
    starts: list[int],
    lengths: list[int],
    cache_dtype: torch.dtype,
) -> None:
    """Each sequence's rows of `out` are causal attention over its first `lengths[b]` tokens as stored."""
    assert out.dtype == q.dtype and torch.isfinite(out).all()  # the NaN of unowned slots never leaks in
    rows = 0
    for kv_b, start, length in zip(kv, starts, lengths, strict=True):
        k, v = (held(kv_b[:length, i], cache_dtype, scale) for i, scale in enumerate((K_SCALE, V_SCALE)))
        num_new = length - start
        expected = causal_attention(q[rows : rows + num_new], k, v)
        assert_close_rel(out[rows : rows + num_new], expected, REL_TOL[q.dtype])
        rows += num_new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_then_decode_is_causal_attention_over_the_stored_kv(
    cache_dtype: torch.dtype, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    pool, layer = bound_layer(cache_dtype)
    runner = StepBatches(PAGE, pool.zero_page, HKV, CPU)
    # a: 9 prompt tokens, its first page a cached prefix; b: 6 fresh ones. Pages 1, 3, 4, 6, 8, 10, 11 unused
    seqs = [Request(b, [3] * n, n, SamplingParams(), 32) for b, n in enumerate((9, 6))]
    seqs[0].block_table, seqs[0].num_cached_tokens, seqs[1].block_table = [7, 2, 9], PAGE, [0, 5]
    kv = [(torch.randn(10, 2, HKV, D, generator=gen) / 5).to(dtype) for _ in seqs]  # [L, K|V, Hkv, D]
    prefix_slots = torch.arange(PAGE) + 7 * PAGE  # as an earlier request's prefill left them
    store_kv_reference(*kv[0][:PAGE].unbind(1), layer.kv, prefix_slots)  # the pool's pages and scales

    q, out = run_step(layer, runner.prepare(seqs, is_prefill=True), kv, [PAGE, 0], gen)
    assert_causal(q, out, kv, [PAGE, 0], [9, 6], cache_dtype)
    for seq in seqs:
        seq.token_ids.append(3)  # a: 10 tokens on its 3 pages; b: 7 on its 2
    q, out = run_step(layer, runner.prepare(seqs, is_prefill=False), kv, [9, 6], gen)
    assert_causal(q, out, kv, [9, 6], [10, 7], cache_dtype)
    for seq, kv_b in zip(seqs, kv, strict=True):  # every store landed in its slot, as the spec quantizes
        pages = torch.tensor(seq.block_table)
        for cache, i, scale in ((pool.caches[0].k_cache, 0, K_SCALE), (pool.caches[0].v_cache, 1, V_SCALE)):
            stored = cache[pages].flatten(0, 1)[: seq.num_tokens]
            expected = quantize_kv(kv_b[: seq.num_tokens, i], cache_dtype, scale[:, None])
            assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
