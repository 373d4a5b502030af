"""Triton MLA decode attention (absorbed, flash-decoding) over FP8 e4m3 or 16-bit latent pages.

Spec: `paged.latent_attention.latent_decode_attention_reference`. The launcher takes the layer's
`PagedLatentCache` (pages, fp32 `k_scale`, checked once when it was made) and checks only q and the
tables. Grid (B, ceil(H / BLOCK_H), num_splits): a program takes BLOCK_H (>= 16, for `tl.dot`) heads of
one sequence over one slice of its tokens (or of its DSA selection, `token_indices`), gathering each
token's row through the block table (any page_size, holes, shared pages, strided slots): scores are
q_nope . kv_c + q_pe . k_pe in two dots, and the output accumulates p @ kv_c. FP8 rows are converted to
fp16 exactly (q, pre-multiplied by sm_scale, too) and k_scale is folded into the scores and the output.
With several splits each writes (out, log-sum-exp) and torch combines them (`triton.paged_attention`).
Imports Triton; loaded lazily by `kvq.runtime.kernels`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.paged.latent_attention import check_latent_queries
from kvq.runtime.kernels.triton.launch import dot, next_pow2
from kvq.runtime.kernels.triton.paged_attention import (
    online_softmax_start,
    online_softmax_step,
    plan_decode,
    store_slice,
)

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.attention import DecodeTables
    from kvq.runtime.kernels.paged.latent_pages import PagedLatentPages


@triton.jit
def latent_decode_kernel(
    q_ptr,
    latent_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    indices_ptr,
    k_scale_ptr,
    o_ptr,
    lse_ptr,
    sm_scale,
    page_size,
    tokens_per_split,
    num_heads,
    num_indices,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_lp,
    stride_lt,
    stride_btb,
    stride_btp,
    stride_ib,
    KV_LORA_RANK: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    IS_FP8: tl.constexpr,
    IS_SPARSE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    IS_FP32_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    num_tokens = num_indices if IS_SPARSE else tl.load(seq_lens_ptr + pid_b)
    start = pid_s * tokens_per_split
    end = tl.minimum(start + tokens_per_split, num_tokens)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_r = offs_r < KV_LORA_RANK
    mask_p = offs_p < ROPE_DIM
    q_base = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_base + offs_r[None, :] * stride_qd, mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    q_pe = tl.load(
        q_base + (KV_LORA_RANK + offs_p[None, :]) * stride_qd,
        mask=mask_h[:, None] & mask_p[None, :],
        other=0.0,
    )
    q_nope = (q_nope.to(tl.float32) * sm_scale).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_R], pre-scaled
    q_pe = (q_pe.to(tl.float32) * sm_scale).to(DOT_DTYPE)  # [BLOCK_H, BLOCK_P]
    k_scale = 1.0  # FP8 rows: one scale for the scores and the output
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
    qk_scale = 1.4426950408889634 * k_scale  # log2(e): scores in log2 units for exp2

    m_i, l_i, acc = online_softmax_start(BLOCK_H, BLOCK_R)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        mask_t = offs_t < end
        if IS_SPARSE:
            positions = tl.load(indices_ptr + pid_b * stride_ib + offs_t, mask=mask_t, other=-1).to(tl.int64)
            mask_t = mask_t & (positions >= 0)
        else:
            positions = offs_t.to(tl.int64)
        page = tl.load(
            block_tables_ptr + pid_b * stride_btb + (positions // page_size) * stride_btp,
            mask=mask_t,
            other=0,
        ).to(tl.int64)
        row = latent_ptr + page[:, None] * stride_lp + (positions % page_size)[:, None] * stride_lt
        kv_c = tl.load(row + offs_r[None, :], mask=mask_t[:, None] & mask_r[None, :], other=0.0)
        k_pe = tl.load(
            row + KV_LORA_RANK + offs_p[None, :], mask=mask_t[:, None] & mask_p[None, :], other=0.0
        )
        kv_c = kv_c.to(DOT_DTYPE)  # [BLOCK_N, BLOCK_R]
        scores = dot(q_nope, tl.trans(kv_c), IS_FP32_DOT) + dot(
            q_pe, tl.trans(k_pe.to(DOT_DTYPE)), IS_FP32_DOT
        )
        scores = tl.where(mask_t[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_i, alpha, p, l_i = online_softmax_step(m_i, l_i, scores)  # a tile may hold no selected token
        acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), kv_c, IS_FP32_DOT)

    store_slice(acc, m_i, l_i, k_scale, o_ptr, lse_ptr, heads, mask_h, num_heads, KV_LORA_RANK, IS_SPLIT)


def latent_decode_attention_triton(
    q: torch.Tensor,
    cache: PagedLatentPages,
    tables: DecodeTables,
    sm_scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton path of `PagedLatentCache.decode_attention`; `tables.max_seq_len` (>= every seq_len) avoids a
    sync, `tables.plan` is not read."""
    latent = cache.latent_cache
    check_latent_queries(q, tables, latent)
    block_tables, seq_lens, max_seq_len, _, token_indices = tables
    num_seqs, num_heads, width = q.shape
    rank = cache.kv_lora_rank
    is_sparse = token_indices is not None
    if is_sparse:
        assert token_indices is not None
        token_indices = token_indices.contiguous()
        max_seq_len = token_indices.shape[1]
    elif max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if num_seqs else 0
    block_h = 16  # tl.dot's smallest M; a 512-wide fp32 accumulator per head is the register budget
    num_head_blocks = triton.cdiv(num_heads, block_h)
    launch = plan_decode(
        latent_decode_kernel, q, latent, rank, max_seq_len, num_head_blocks, 32, block_n, num_splits
    )
    if launch is None:
        return q.new_zeros(num_seqs, num_heads, rank)
    out, lse = launch.splits.out, launch.splits.lse  # [B, H, S, R], [B, H, S]
    indices = token_indices if token_indices is not None else seq_lens  # unread when dense
    launch.kernel[launch.grid](
        q,
        latent,
        block_tables,
        seq_lens,
        indices,
        cache.k_scale,
        out,
        lse,
        sm_scale,
        cache.page_size,
        launch.splits.tokens_per_split,
        num_heads,
        max_seq_len if is_sparse else 0,
        *q.stride(),
        latent.stride(0),
        latent.stride(1),
        *block_tables.stride(),
        indices.stride(0),
        KV_LORA_RANK=rank,
        ROPE_DIM=width - rank,
        IS_SPARSE=is_sparse,
        BLOCK_H=block_h,
        BLOCK_R=max(16, next_pow2(rank)),
        BLOCK_P=max(16, next_pow2(width - rank)),
        **launch.constexprs,
        num_warps=8,
        num_stages=2,
    )
    return launch.splits.merge(q.dtype)
