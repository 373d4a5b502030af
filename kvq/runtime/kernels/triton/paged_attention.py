"""Triton paged decode attention (flash-decoding) over FP8 e4m3 or 16-bit pages with GQA, and the
flash-decoding pieces the MLA latent kernel shares (`triton.latent_attention`).

Spec: `paged.attention.paged_decode_attention_reference`. The launcher takes the layer's `PagedKVCache`
(pages, fp32 `[Hkv]` scales, checked once when it was made) and checks only q and the tables.
Grid (B, Hkv, num_splits): a program takes one KV head with all its query heads (padded to
BLOCK_H >= 16 rows for `tl.dot`) over one slice of the sequence, gathering token rows through the block
table (any page_size, holes, shared pages). FP8 K/V are converted to fp16 exactly (q, pre-multiplied by
sm_scale, too) and the per-head k/v scales are folded into the scores and the output.
Flash-decoding: a program runs an online softmax over one slice of a sequence's tokens
(`online_softmax_start`, `online_softmax_step` per tile of scores in log2 units, `finish` at the end: the
normalized output and, when split, the slice's log-sum-exp, written by `store_slice`); the host plans the
launch (`plan_decode`: the kernel's mode, its dot operands and the slices, `plan_splits`: ~2 programs per
SM, >= 4 tiles a slice) and merges the slices by log-sum-exp (`Splits.merge`).
Imports Triton; loaded lazily by `kvq.runtime.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.kv_cache_layout import check_decode_queries, default_sm_scale, is_fp8
from kvq.runtime.kernels.triton.launch import (
    dot,
    dot_constexprs,
    is_interpreted,
    kernel_for,
    next_pow2,
    output_dtype,
    sm_count_for,
)

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.attention import DecodeTables
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


@triton.jit
def online_softmax_start(BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """(m, l, acc) before the first tile: the running max `[H]` at -inf, the running sum `[H]` and the
    output `[H, D]` at zero (fp32)."""
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    return m_i, tl.zeros((BLOCK_H,), dtype=tl.float32), tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)


@triton.jit
def online_softmax_step(m_i, l_i, scores):
    """(m, alpha, p, l) after one tile of scores `[H, N]` (log2 units, -inf = not a token): the running
    max, the factor that rescales what came before, the tile's weights, the running sum. A row with no
    token yet stays at m = -inf with zero weights."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def finish(acc, m_i, l_i, v_scale):
    """(acc * v_scale / l `[H, D]`, the natural log-sum-exp `[H]`; -inf and zeros for a slice with no
    token)."""
    is_empty = l_i == 0.0
    safe_l = tl.where(is_empty, 1.0, l_i)
    lse = tl.where(is_empty, float("-inf"), (m_i + tl.log2(safe_l)) * 0.6931471805599453)
    return acc * (v_scale / safe_l)[:, None], lse


@triton.jit
def store_slice(
    acc,
    m_i,
    l_i,
    v_scale,
    o_ptr,
    lse_ptr,
    heads,
    mask_h,
    num_heads,
    WIDTH: tl.constexpr,
    IS_SPLIT: tl.constexpr,
):
    """`finish` a program's slice and write rows `heads` of it, and their log-sum-exp when split, at the
    program's sequence (axis 0) and slice (axis 2) of the contiguous buffers of `plan_splits`: `o_ptr`
    `[B, num_heads, num_splits, WIDTH]`, `lse_ptr` `[B, num_heads, num_splits]`."""
    out, lse = finish(acc, m_i, l_i, v_scale)
    rows = (tl.program_id(0).to(tl.int64) * num_heads + heads) * tl.num_programs(2) + tl.program_id(2)
    offs_d = tl.arange(0, out.shape[1])
    mask = mask_h[:, None] & (offs_d < WIDTH)[None, :]
    tl.store(o_ptr + rows[:, None] * WIDTH + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)
    if IS_SPLIT:
        tl.store(lse_ptr + rows, lse, mask=mask_h)


@dataclass(frozen=True)
class Splits:
    """How a launch cuts its sequences and where the slices write: `out` `[B, H, num_splits, D]` (fp32
    when split) and `lse` `[B, H, num_splits]` (empty when not)."""

    num_splits: int
    tokens_per_split: int
    out: torch.Tensor
    lse: torch.Tensor

    @property
    def is_split(self) -> bool:
        return self.num_splits > 1

    def merge(self, dtype: torch.dtype) -> torch.Tensor:
        """The launch's output `[B, H, D]` in `dtype`: the slices merged by their log-sum-exp."""
        if not self.is_split:
            return self.out.squeeze(2).to(dtype)
        lse = self.lse
        lse_max = lse.amax(dim=-1, keepdim=True)
        lse_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)  # empty sequences
        weights = torch.exp(lse - lse_max)  # [B, H, S]
        total = weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        return torch.einsum("bhs,bhsd->bhd", weights / total, self.out).to(dtype)


def plan_splits(
    q: torch.Tensor,
    width: int,
    max_seq_len: int,
    block_n: int,
    num_head_programs: int,
    interpreted: bool,
    num_splits: int | None = None,
) -> Splits:
    """Slices of `max_seq_len` tokens (whole tiles of `block_n`) for a grid of B x `num_head_programs`,
    and their output buffers for q `[B, H, *]` and outputs `width` wide."""
    num_seqs, num_heads = q.shape[:2]
    if num_splits is None:
        wanted = triton.cdiv(2 * sm_count_for(q.device), max(num_seqs * num_head_programs, 1))
        num_splits = max(1, min(wanted, triton.cdiv(max_seq_len, 4 * block_n)))
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, tokens_per_split)
    if num_splits > 1:
        out = torch.empty((num_seqs, num_heads, num_splits, width), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        out_dtype = output_dtype(q.dtype, interpreted)
        out = torch.empty((num_seqs, num_heads, 1, width), dtype=out_dtype, device=q.device)
        lse = torch.empty((0, 0, 0), dtype=torch.float32, device=q.device)
    return Splits(num_splits, tokens_per_split, out, lse)


@dataclass(frozen=True)
class DecodeLaunch:
    """A decode attention launch: `kernel[grid](...)`, its slices, and `constexprs`, the arguments every
    decode kernel takes alike (IS_FP8, IS_SPLIT, DOT_DTYPE, IS_FP32_DOT, BLOCK_N)."""

    kernel: Any
    grid: tuple[int, int, int]
    splits: Splits
    constexprs: dict[str, Any]


def plan_decode(
    kernel: Any,
    q: torch.Tensor,
    pages: torch.Tensor,
    width: int,
    max_seq_len: int,
    num_head_programs: int,
    compiled_block_n: int,
    block_n: int | None,
    num_splits: int | None,
) -> DecodeLaunch | None:
    """The launch of `kernel` for q `[B, H, *]` over `pages` (FP8 or 16-bit) with outputs `width` wide and
    B x `num_head_programs` x slices programs; None when there is no token (the output is zeros).
    Tokens per tile: `block_n`, else `compiled_block_n` compiled and 16 under the interpreter."""
    kernel = kernel_for(kernel, q.device)
    interpreted = is_interpreted(kernel)
    block_n = block_n or (16 if interpreted else compiled_block_n)
    if q.shape[0] == 0 or max_seq_len == 0:
        return None
    splits = plan_splits(q, width, max_seq_len, block_n, num_head_programs, interpreted, num_splits)
    # fp8 pages convert to fp16 in one instruction (to bf16 in two); fp32 queries keep fp32 dots
    dot_input_dtype = torch.float16 if is_fp8(pages) and q.dtype != torch.float32 else q.dtype
    constexprs = {
        "IS_FP8": is_fp8(pages),
        "IS_SPLIT": splits.is_split,
        "BLOCK_N": block_n,
        **dot_constexprs(dot_input_dtype, interpreted),
    }
    return DecodeLaunch(kernel, (q.shape[0], num_head_programs, splits.num_splits), splits, constexprs)


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

    m_i, l_i, acc = online_softmax_start(BLOCK_H, BLOCK_D)
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

    v_scale = 1.0
    if IS_FP8:
        v_scale = tl.load(v_scale_ptr + pid_kvh * stride_vs)
    mask_h = offs_h < QUERIES_PER_KV
    num_heads = tl.num_programs(1) * QUERIES_PER_KV
    store_slice(acc, m_i, l_i, v_scale, o_ptr, lse_ptr, heads, mask_h, num_heads, HEAD_DIM, IS_SPLIT)


def paged_decode_attention_triton(
    q: torch.Tensor,
    kv: PagedKVPages,
    tables: DecodeTables,
    sm_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton path of `PagedKVCache.decode_attention` (pages and scales checked when `kv` was made);
    `tables.max_seq_len` (>= every seq_len) avoids a device sync, `tables.plan` is not read."""
    k_cache, v_cache, k_scale, v_scale = kv.k_cache, kv.v_cache, kv.k_scale, kv.v_scale
    block_tables, seq_lens, max_seq_len, _, _ = tables
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
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, next_pow2(queries_per_kv)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        **launch.constexprs,
        num_warps=4,
        num_stages=2,
    )
    return launch.splits.merge(q.dtype)
