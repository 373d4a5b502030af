"""Paged decode attention: one new query token per sequence attends over its cached K/V pages.

q `[B, Hq, D]` (Hq a multiple of Hkv: query head h reads KV head h // (Hq / Hkv)), caches and tables as
in `kv_cache_layout`; out `[B, Hq, D]` in q.dtype; softmax(q.k * sm_scale) over the first seq_lens[b]
cached tokens (a sequence of length 0 gives zeros). This file holds the reference (the spec), which
is also the torch path; the Triton flash-decoding kernel is in `paged_attention_triton.py`.
Imports torch only.
"""

from __future__ import annotations

import math

import torch

from kvq.runtime.kernels.kv_cache_layout import check_kv_cache, dequantize_kv, per_head_scale


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int]:
    """(page_size, num_kv_heads, head_dim) after checking shapes, dtypes, devices (ValueError/TypeError)."""
    page_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, expected [B, Hq, {head_dim}] with Hq a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must be "
            f"[{num_seqs}, max_pages] and [{num_seqs}]"
        )
    if block_tables.is_floating_point() or seq_lens.is_floating_point() or not q.is_floating_point():
        raise TypeError(
            f"block_tables and seq_lens must be integer and q float, got {block_tables.dtype}, "
            f"{seq_lens.dtype}, {q.dtype}"
        )
    if not (q.device == block_tables.device == seq_lens.device == k_cache.device):
        raise ValueError(
            f"q, block_tables, seq_lens and the caches must share a device, got {q.device}, "
            f"{block_tables.device}, {seq_lens.device}, {k_cache.device}"
        )
    return page_size, num_kv_heads, head_dim


def default_sm_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the softmax scale when none is given."""
    return 1.0 / math.sqrt(head_dim)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The spec, in fp32, one sequence at a time: `[B, Hq, D]` in q.dtype."""
    page_size, num_kv_heads, head_dim = check_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    k_scale = per_head_scale(k_scale, num_kv_heads, q.device, "k_scale")
    v_scale = per_head_scale(v_scale, num_kv_heads, q.device, "v_scale")
    queries_per_kv = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [B, Hq, D]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[b, : -(-seq_len // page_size)].long()
        k = dequantize_kv(k_cache[pages].flatten(0, 1)[:seq_len], k_scale)  # [L, Hkv, D]
        v = dequantize_kv(v_cache[pages].flatten(0, 1)[:seq_len], v_scale)
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale  # [Hq, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)
