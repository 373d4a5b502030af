"""Paged decode attention: one new query token per sequence attends over its cached K/V pages.

q `[B, Hq, D]` (Hq a multiple of Hkv: query head h reads KV head h // (Hq / Hkv)), caches and tables as
in `kv_cache_layout`; out `[B, Hq, D]` in q.dtype; softmax(q.k * sm_scale) over the first seq_lens[b]
cached tokens (a sequence of length 0 gives zeros). This file holds the reference (the spec, one
sequence at a time) and the torch path (all sequences at once, over a `PagedKVCache` and a
`PagedDecodePlan`: the per-step index work every layer shares), which hands bf16 queries on CPU to kvq's C
op (the kv's `cpu_ops.decode_attention`: bf16 or FP8 pages read in place, fp32 inside); the Triton
flash-decoding kernel is in `triton/paged_attention.py`.
Imports torch and kvq.runtime.kernels.paged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kvq.formats.fp8_e4m3 import fp8_bits_to
from kvq.runtime.kernels.kv_cache_layout import check_decode_queries, default_sm_scale, dequantize_kv, is_fp8

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages

# decode batch x context slots up to which fp32 matmuls are the fastest on CPU; above it they fall off a
# cliff and bf16 (AVX-512 BF16) is steady
_SMALL_ATTENTION = 1024


class PagedDecodePlan(NamedTuple):  # a tuple: made by every layer of a step from the batch, cheaply
    """The torch path's index work for one decode step, made once and shared by every layer.

    `context_slots` int64 `[B, C]` (C >= every seq_len): the slot of each context token; past a sequence's
    end, any slot whose K and V are finite (the engine's all-zero page; `plan_paged_decode`: the
    sequence's first slot), so a zero weight never meets NaN from slots it does not own.
    `attn_bias` fp32 `[B * Hkv, 1, C]` (row b * Hkv + h: sequence b, KV head h): 0 on context tokens,
    -inf past the end. `is_empty` bool `[B]` where some seq_len is 0 (their rows are zeroed), else None.
    """

    context_slots: torch.Tensor
    attn_bias: torch.Tensor
    is_empty: torch.Tensor | None = None


class DecodeTables(NamedTuple):
    """What a decode step's attention reads besides q and the pages, made once a step and read by every layer
    (`ForwardBatch.decode_tables`): `block_tables` int32 `[B, max_pages]` (`kv_cache_layout`), `seq_lens`
    `[B]` (the context each query attends to), `max_seq_len` >= every
    seq_len (known to the scheduler; None: read from seq_lens, a device sync), `plan` (the step's
    `plan_paged_decode`, shared by every layer: spares the torch path its index work; Triton ignores it)
    and, for MLA only, `token_indices` `[B, K]` (DSA's selection: the positions attended to, -1 = none)."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int | None = None
    plan: PagedDecodePlan | None = None
    token_indices: torch.Tensor | None = None


def paged_decode_attention_reference(
    q: torch.Tensor, kv: PagedKVPages, tables: DecodeTables, sm_scale: float | None = None
) -> torch.Tensor:
    """The spec, in fp32, one sequence at a time: `[B, Hq, D]` in q.dtype."""
    block_tables, seq_lens = tables.block_tables, tables.seq_lens
    check_decode_queries(q, block_tables, seq_lens, kv.k_cache)
    _, page_size, num_kv_heads, head_dim = kv.k_cache.shape
    sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    queries_per_kv = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [B, Hq, D]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[b, : -(-seq_len // page_size)].long()
        k = dequantize_kv(kv.k_cache[pages].flatten(0, 1)[:seq_len], kv.k_scale)  # [L, Hkv, D]
        v = dequantize_kv(kv.v_cache[pages].flatten(0, 1)[:seq_len], kv.v_scale)
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale  # [Hq, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v)
    return out.to(q.dtype)


def plan_paged_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_kv_heads: int,
    max_seq_len: int,
    pad_slot: int | None = None,
    has_empty: bool | None = None,
) -> PagedDecodePlan:
    """The `PagedDecodePlan` of a decode step; `max_seq_len` >= every seq_len. Slots past an end read
    `pad_slot` (the engine: a slot of its all-zero page), else the sequence's first slot (slot 0 for an
    empty sequence, whose output is zeroed). `has_empty`: whether some seq_len is 0, when the caller
    knows (spares a device sync)."""
    num_slots = min(max_seq_len, block_tables.shape[1] * page_size)  # a table holds every seq_len
    pages = block_tables[:, : -(-num_slots // page_size)].long()  # [B, n]
    offsets = torch.arange(page_size, device=pages.device)
    slots = (pages[:, :, None] * page_size + offsets).flatten(1)[:, :num_slots]  # [B, C]
    is_past_end = torch.arange(num_slots, device=pages.device) >= seq_lens[:, None]  # [B, C]
    is_empty = seq_lens == 0
    if pad_slot is None:
        pad = slots[:, :1].masked_fill(is_empty[:, None], 0)  # an empty sequence's table may be all padding
        context_slots = torch.where(is_past_end, pad, slots)
    else:
        context_slots = slots.masked_fill(is_past_end, pad_slot)
    attn_bias = torch.zeros(is_past_end.shape, device=pages.device).masked_fill_(is_past_end, float("-inf"))
    return PagedDecodePlan(
        context_slots,
        attn_bias.repeat_interleave(num_kv_heads, dim=0)[:, None, :],  # [B * Hkv, 1, C]
        is_empty if (bool(is_empty.any()) if has_empty is None else has_empty) else None,
    )


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without a dispatch when it already is (a no-op `.to` still costs ~1 us on CPU)."""
    return x if x.dtype == dtype else x.to(dtype)


def _check_plan(plan: PagedDecodePlan, num_seqs: int, num_kv_heads: int) -> int:
    """The plan's context width C after checking it was made for this batch (ValueError)."""
    num_slots = plan.context_slots.shape[1]
    expected_bias = (num_seqs * num_kv_heads, 1, num_slots)
    if plan.context_slots.shape[0] != num_seqs or plan.attn_bias.shape != expected_bias:
        raise ValueError(
            f"plan has context_slots {tuple(plan.context_slots.shape)} and attn_bias "
            f"{tuple(plan.attn_bias.shape)}, expected [{num_seqs}, C] and [{num_seqs * num_kv_heads}, 1, C]"
        )
    return num_slots


def _gather_kv(kv: PagedKVPages, slots: torch.Tensor) -> torch.Tensor:
    """K and V at `slots` `[B, C]` as stored: `[2, B, C, Hkv, D]` (one gather when `kv.kv_rows` allows)."""
    if kv.kv_rows is None:
        page_size = kv.k_cache.shape[1]
        pages, offsets = slots // page_size, slots % page_size
        return torch.stack([kv.k_cache[pages, offsets], kv.v_cache[pages, offsets]])
    return kv.kv_rows.index_select(1, slots.flatten()).view(2, *slots.shape, *kv.k_cache.shape[2:])


def paged_decode_attention_torch(
    q: torch.Tensor, kv: PagedKVPages, tables: DecodeTables, sm_scale: float | None = None
) -> torch.Tensor:
    """The torch path: every sequence at once with batched matmuls: `[B, Hq, D]` in q.dtype.

    FP8 pages are read by moving bits (value * 2^-120); the scale * 2^120 factors go on the (small) query
    for K and on the output for V instead of on every K/V element.
    """
    block_tables, seq_lens, max_seq_len, plan, _ = tables
    check_decode_queries(q, block_tables, seq_lens, kv.k_cache)
    _, page_size, num_kv_heads, head_dim = kv.k_cache.shape
    ops = kv.cpu_ops
    if ops.attention_applies(q, kv.k_cache, block_tables, seq_lens):  # CPU bf16 queries: one C call
        sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
        return ops.decode_attention(
            q, kv.k_cache, kv.v_cache, kv.stacked_scales, block_tables, seq_lens, sm_scale
        )
    num_seqs, num_heads, _ = q.shape
    if plan is None:
        max_seq_len = (int(seq_lens.max()) if num_seqs else 0) if max_seq_len is None else max_seq_len
        if max_seq_len == 0:
            return torch.zeros_like(q)
        plan = plan_paged_decode(block_tables, seq_lens, page_size, num_kv_heads, max_seq_len)
    num_slots = _check_plan(plan, num_seqs, num_kv_heads)
    sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    is_small = num_seqs * num_slots <= _SMALL_ATTENTION
    dtype = torch.bfloat16 if q.dtype == torch.bfloat16 and not is_small else torch.float32
    group, rows = num_heads // num_kv_heads, num_seqs * num_kv_heads
    stored = _gather_kv(kv, plan.context_slots)  # [2, B, C, Hkv, D]
    k_t = stored[0].permute(0, 2, 3, 1).reshape(rows, head_dim, num_slots)  # [B * Hkv, D, C]
    v = stored[1].permute(0, 2, 1, 3).reshape(rows, num_slots, head_dim)  # [B * Hkv, C, D]
    q_grouped = q.view(num_seqs, num_kv_heads, group, head_dim)  # head h reads KV head h // group
    is_fp8_pages = is_fp8(kv.k_cache)
    if is_fp8_pages:  # K/V as value * 2^-120: scale * 2^120 goes on q (for K) and on the output (for V)
        k_t, v = fp8_bits_to(k_t, dtype), fp8_bits_to(v, dtype)
        q_grouped = q_grouped * kv.fp8_read_factors[0]  # fp32
    else:
        k_t, v = _cast(k_t, dtype), _cast(v, dtype)
    q_grouped = _cast(q_grouped, dtype).reshape(rows, group, head_dim)
    scores = torch.baddbmm(_cast(plan.attn_bias, dtype), q_grouped, k_t, alpha=sm_scale)  # [B*Hkv, G, C]
    probs = _cast(torch.softmax(scores, dim=-1, dtype=torch.float32), dtype)
    out = torch.bmm(probs, v).view(num_seqs, num_kv_heads, group, head_dim)
    if is_fp8_pages:
        out = out * kv.fp8_read_factors[1]  # fp32
    out = _cast(out, q.dtype).view(num_seqs, num_heads, head_dim)
    return out if plan.is_empty is None else out.masked_fill_(plan.is_empty[:, None, None], 0.0)
