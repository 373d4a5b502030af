"""The flash-decoding pieces the Triton decode attention kernels share (GQA pages, the MLA latent).

A program runs an online softmax over one slice of a sequence's tokens (`online_softmax_step` per tile
of scores in log2 units, `finish` at the end: the normalized output and, when split, the slice's
log-sum-exp); the host sizes the slices (`plan_splits`: ~2 programs per SM, >= 4 tiles a slice) and
merges them by log-sum-exp (`merge_splits`). Imports Triton; loaded lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.triton.launch import output_dtype, sm_count_for


@triton.jit
def dot(a, b, IS_FP32_DOT: tl.constexpr):
    """`tl.dot`, fp32-exact for fp32 operands (not tf32)."""
    if IS_FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


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


def merge_splits(splits: Splits, dtype: torch.dtype) -> torch.Tensor:
    """The launch's output `[B, H, D]` in `dtype`: the slices merged by their log-sum-exp."""
    if not splits.is_split:
        return splits.out.squeeze(2).to(dtype)
    lse = splits.lse
    lse_max = lse.amax(dim=-1, keepdim=True)
    lse_max = torch.where(torch.isinf(lse_max), torch.zeros_like(lse_max), lse_max)  # empty sequences
    weights = torch.exp(lse - lse_max)  # [B, H, S]
    total = weights.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum("bhs,bhsd->bhd", weights / total, splits.out).to(dtype)
