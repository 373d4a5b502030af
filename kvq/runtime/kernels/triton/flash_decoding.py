"""The flash-decoding pieces the Triton decode attention kernels share (GQA pages, the MLA latent).

A program runs an online softmax over one slice of a sequence's tokens (`online_softmax_step` per tile
of scores in log2 units, `finish` at the end: the normalized output and, when split, the slice's
log-sum-exp, written by `store_slice`); the host plans the launch (`plan_decode`: the kernel's mode,
its dot operands and the slices, `plan_splits`: ~2 programs per SM, >= 4 tiles a slice) and merges the
slices by log-sum-exp (`Splits.merge`). Imports Triton; loaded lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.kv_cache_layout import is_fp8
from kvq.runtime.kernels.triton.launch import (
    dot_constexprs,
    is_interpreted,
    kernel_for,
    output_dtype,
    sm_count_for,
)


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
    v_scale_ptr,
    o_ptr,
    lse_ptr,
    heads,
    offs_d,
    mask_h,
    mask_d,
    stride_oh,
    stride_od,
    stride_lh,
    IS_FP8: tl.constexpr,
    IS_SPLIT: tl.constexpr,
):
    """`finish` a program's slice (V's scale at `v_scale_ptr` for FP8 pages) and write rows `heads` of it
    into `o_ptr`, and their log-sum-exp into `lse_ptr` when split: the program's sequence and slice in the
    buffers of `plan_splits`."""
    v_scale = 1.0
    if IS_FP8:
        v_scale = tl.load(v_scale_ptr)
    out, lse = finish(acc, m_i, l_i, v_scale)
    o_ptrs = o_ptr + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    if IS_SPLIT:
        tl.store(lse_ptr + heads * stride_lh, lse, mask=mask_h)


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
