"""Triton paged decode attention (flash-decoding) over FP8 e4m3 or 16-bit pages with GQA.

Spec: `paged.attention.paged_decode_attention_reference`. The launcher takes the layer's `PagedKVCache`
(pages, fp32 `[Hkv]` scales, checked once when it was made) and checks only q and the tables.
Grid (B, Hkv, num_splits): a program takes one KV head with all its query heads (padded to
BLOCK_H >= 16 rows for `tl.dot`) over one slice of the sequence, gathering token rows through the block
table (any page_size, holes, shared pages). FP8 K/V are converted to fp16 exactly (q, pre-multiplied by
sm_scale, too) and the per-head k/v scales are folded into the scores and the output. With several
splits, each writes (out, log-sum-exp) and torch combines them (`triton.flash_decoding`).
Imports Triton; loaded lazily by `kvq.runtime.kernels`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.kv_cache_layout import check_decode_queries, default_sm_scale
from kvq.runtime.kernels.triton.flash_decoding import online_softmax_step, plan_decode, store_slice
from kvq.runtime.kernels.triton.launch import dot, next_pow2

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    o_ptr,
    lse_ptr,
    sm_scale,
    page_size,
    tokens_per_split,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_btp,
    stride_ks,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IS_FP32_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_kvh = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b)
    start = pid_s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    heads = pid_kvh * QUERIES_PER_KV + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_hd = (offs_h < QUERIES_PER_KV)[:, None] & mask_d[None, :]
    q = tl.load(
        q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_hd,
        other=0.0,
    )
    q = (q.to(tl.float32) * sm_scale).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_D], pre-scaled: small for fp16
    k_base = k_cache_ptr + pid_kvh * stride_kh + offs_d[None, :] * stride_kd
    v_base = v_cache_ptr + pid_kvh * stride_vh + offs_d[None, :] * stride_vd
    qk_scale = 1.4426950408889634  # log2(e): scores in log2 units for exp2
    if IS_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + pid_kvh * stride_ks)

    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < end
        page = tl.load(
            block_tables_ptr + pid_b * stride_btb + (offs_t // page_size) * stride_btp, mask=mask_t, other=0
        ).to(tl.int64)
        slot = (offs_t % page_size).to(tl.int64)
        mask_td = mask_t[:, None] & mask_d[None, :]
        k = tl.load(k_base + page[:, None] * stride_kp + slot[:, None] * stride_kt, mask=mask_td, other=0.0)
        scores = dot(q, tl.trans(k.to(DOT_DTYPE)), IS_FP32_DOT)
        scores = tl.where(mask_t[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, scores)
        v = tl.load(v_base + page[:, None] * stride_vp + slot[:, None] * stride_vt, mask=mask_td, other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), IS_FP32_DOT)

    store_slice(
        acc,
        m_i,
        l_i,
        v_scale_ptr + pid_kvh * stride_vs,
        o_ptr + pid_b * stride_ob + pid_s * stride_os,
        lse_ptr + pid_b * stride_lb + pid_s * stride_ls,
        heads,
        offs_d,
        offs_h < QUERIES_PER_KV,
        mask_d,
        stride_oh,
        stride_od,
        stride_lh,
        IS_FP8,
        IS_SPLIT,
    )


def paged_decode_attention_triton(
    q: torch.Tensor,
    kv: PagedKVPages,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton path of `PagedKVCache.decode_attention` (pages and scales checked when `kv` was made);
    `max_seq_len` (>= every seq_len) avoids a device sync."""
    k_cache, v_cache, k_scale, v_scale = kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale
    check_decode_queries(q, block_tables, seq_lens, k_cache)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_q_heads, _ = q.shape
    sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    launch = plan_decode(
        paged_decode_kernel, q, k_cache, head_dim, max_seq_len, num_kv_heads, 64, block_n, num_splits
    )
    if launch is None:
        return torch.zeros_like(q)
    out, lse = launch.splits.out, launch.splits.lse  # [B, Hq, S, D], [B, Hq, S]
    queries_per_kv = num_q_heads // num_kv_heads
    launch.kernel[launch.grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        k_scale,
        v_scale,
        out,
        lse,
        sm_scale,
        page_size,
        launch.splits.tokens_per_split,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        k_scale.stride(0),
        v_scale.stride(0),
        *out.stride(),
        *lse.stride(),
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(queries_per_kv)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        **launch.constexprs,
        num_warps=4,
        num_stages=2,
    )
    return launch.splits.merge(q.dtype)
