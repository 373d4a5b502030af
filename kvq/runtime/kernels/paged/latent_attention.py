"""MLA decode attention over the paged latent, in the absorbed form: one new query token per sequence, all
heads attending to the same latent rows (MQA whose keys are `kv_c ++ k_pe` and whose values are `kv_c`).

q `[B, H, R + rope]` is `q_nope @ W_UK` (the `kv_b_proj` rows that make K_nope, folded into the query)
beside the RoPE'd `q_pe`; out `[B, H, R]` = softmax(q . row * sm_scale) @ kv_c in q.dtype, over each
sequence's first seq_lens[b] tokens, or over the positions `token_indices[b, j] >= 0` (DSA's selection,
-1 = none); W_UV is the caller's to apply. A sequence with no token gives zeros. This file holds the
reference (the spec, one sequence at a time, fp32) and the torch path (every sequence at once, over the
step's `PagedDecodePlan`, made with one KV head); the Triton kernel is in `triton/latent_attention.py`.
Imports torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvq.formats.fp8_e4m3 import fp8_bits_to
from kvq.runtime.kernels.kv_cache_layout import is_fp8
from kvq.runtime.kernels.paged.attention import DecodeTables, plan_paged_decode

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.latent_pages import PagedLatentPages

_SMALL_ATTENTION = 1024  # as for GQA: up to this many queries x slots, fp32 matmuls are the fastest on CPU


def check_latent_queries(q: torch.Tensor, tables: DecodeTables, latent_cache: torch.Tensor) -> None:
    """q and the tables (block_tables, seq_lens, token_indices) against checked latent pages
    (ValueError/TypeError)."""
    block_tables, seq_lens, _, _, token_indices = tables
    width, num_seqs = latent_cache.shape[2], q.shape[0] if q.dim() == 3 else -1
    if q.dim() != 3 or q.shape[2] != width:
        raise ValueError(f"q has shape {tuple(q.shape)}, expected [B, H, {width}] (q_nope @ W_UK ++ q_pe)")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or tuple(seq_lens.shape) != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} must be "
            f"[{num_seqs}, max_pages] and [{num_seqs}]"
        )
    if token_indices is not None and (token_indices.dim() != 2 or token_indices.shape[0] != num_seqs):
        raise ValueError(f"token_indices {tuple(token_indices.shape)} must be [{num_seqs}, K]")
    integers = [block_tables, seq_lens] + ([] if token_indices is None else [token_indices])
    if any(t.is_floating_point() for t in integers) or not q.is_floating_point():
        raise TypeError(f"block_tables, seq_lens, token_indices must be integer and q float, got q {q.dtype}")
    if any(t.device != q.device for t in [latent_cache, *integers]):
        raise ValueError("q, block_tables, seq_lens, token_indices and the cache must share a device")


def selected_slots(
    block_tables: torch.Tensor, token_indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots int64 `[B, K]`, is_valid bool `[B, K]`) of the selected positions; an unused entry reads the
    slot of its row's first entry (written, so finite; a row with none valid is zeroed by the caller)."""
    positions = token_indices.long()
    is_valid = positions >= 0
    safe = torch.where(is_valid, positions, positions[:, :1].clamp_min(0))
    pages = block_tables.long().gather(1, safe // page_size).clamp_min(0)  # an empty row's table is padding
    return pages * page_size + safe % page_size, is_valid


def latent_decode_attention_reference(
    q: torch.Tensor, cache: PagedLatentPages, tables: DecodeTables, sm_scale: float
) -> torch.Tensor:
    """The spec, in fp32, one sequence at a time: `[B, H, R]` in q.dtype."""
    latent_cache, kv_lora_rank, scale = cache.latent_cache, cache.kv_lora_rank, cache.k_scale
    check_latent_queries(q, tables, latent_cache)
    block_tables, seq_lens, _, _, token_indices = tables
    page_size = latent_cache.shape[1]
    out = torch.zeros(*q.shape[:2], kv_lora_rank, dtype=torch.float32, device=q.device)  # [B, H, R]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if token_indices is None:
            positions = torch.arange(seq_len, device=q.device)
        else:
            positions = token_indices[b][token_indices[b] >= 0].long()
        if positions.numel() == 0:
            continue
        pages = block_tables[b].long()[positions // page_size]
        rows = latent_cache[pages, positions % page_size].float()  # [L, W]
        rows = rows * scale if is_fp8(latent_cache) else rows
        scores = q[b].float() @ rows.T * sm_scale  # [H, L]
        out[b] = scores.softmax(dim=-1) @ rows[:, :kv_lora_rank]
    return out.to(q.dtype)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def latent_decode_attention_torch(
    q: torch.Tensor, cache: PagedLatentPages, tables: DecodeTables, sm_scale: float
) -> torch.Tensor:
    """The torch path: every sequence at once with batched matmuls over gathered rows: `[B, H, R]`.

    FP8 rows are read by moving bits (value * 2^-120); scale * 2^120 goes on the query (for the scores)
    and on the output (for the values) instead of on every element.
    """
    check_latent_queries(q, tables, cache.latent_cache)
    block_tables, seq_lens, max_seq_len, plan, token_indices = tables
    num_seqs, num_heads, width = q.shape
    rank, page_size, out_dtype = cache.kv_lora_rank, cache.page_size, q.dtype
    is_empty: torch.Tensor | None = None
    if token_indices is not None:
        slots, is_valid = selected_slots(block_tables, token_indices, page_size)
        bias = torch.zeros(is_valid.shape, device=q.device).masked_fill_(~is_valid, float("-inf"))[:, None]
        is_empty = ~is_valid.any(dim=1)
    else:
        if plan is None:
            max_seq_len = (int(seq_lens.max()) if num_seqs else 0) if max_seq_len is None else max_seq_len
            if max_seq_len == 0:
                return q.new_zeros(num_seqs, num_heads, rank)
            plan = plan_paged_decode(block_tables, seq_lens, page_size, 1, max_seq_len)
        slots, bias, is_empty = plan.context_slots, plan.attn_bias, plan.is_empty  # bias [B, 1, C]
    num_slots = slots.shape[1]
    if bias.shape != (num_seqs, 1, num_slots):
        raise ValueError(f"the decode plan was made for another batch: bias {tuple(bias.shape)}, one KV head")
    is_small = num_seqs * num_slots <= _SMALL_ATTENTION
    dtype = torch.bfloat16 if q.dtype == torch.bfloat16 and not is_small else torch.float32
    rows = cache.latent_rows.index_select(0, slots.flatten()).view(num_seqs, num_slots, width)  # [B, C, W]
    is_fp8_rows = is_fp8(rows)
    if is_fp8_rows:
        rows, q = fp8_bits_to(rows, dtype), q * cache.fp8_read_factor
    else:
        rows = _cast(rows, dtype)
    scores = torch.baddbmm(_cast(bias, dtype), _cast(q, dtype), rows.transpose(1, 2), alpha=sm_scale)
    probs = _cast(torch.softmax(scores, dim=-1, dtype=torch.float32), dtype)  # [B, H, C]
    out = torch.bmm(probs, rows[:, :, :rank])  # [B, H, R]
    if is_fp8_rows:
        out = out * cache.fp8_read_factor
    out = _cast(out, out_dtype)
    return out if is_empty is None else out.masked_fill_(is_empty[:, None, None], 0.0)
