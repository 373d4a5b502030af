"""Paged prefill attention: each sequence's new tokens attend causally over its whole context, read back
from its pages (a cached prefix and a fresh prefill see the same K/V).

Torch on every device, no Triton kernel: one `scaled_dot_product_attention` per group of sequences with
the same query and context lengths (one per sequence when all differ; one for a batch of the same
prompt, or a prompt sampled n times) over their gathered pages (a `PagedKVCache`), in fp32 on CPU and
in q's dtype elsewhere (CUDA: the fused SDPA kernels; prompts with no cached prefix take the causal fast
path). The spec is dense causal attention over the same K/V. Imports torch only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvq.formats.fp8_e4m3 import fp8_bits_to
from kvq.runtime.kernels.kv_cache_layout import default_sm_scale, is_fp8

if TYPE_CHECKING:
    from kvq.runtime.kernels.paged.kv_pages import PagedKVPages


GROUP_CONTEXT_TOKENS = 1 << 16  # context tokens one call gathers for a group (64 seqs x 1K, 8 x 8K)


def read_pages(cache: torch.Tensor, pages: torch.Tensor, seq_len: int, factor: torch.Tensor) -> torch.Tensor:
    """Sequences' first `seq_len` K or V `[G, seq_len, Hkv, D]` as fp32 values from their `pages` `[G, n]`;
    `factor` fp32 `[Hkv, 1, 1]` (FP8 pages: scale * 2^120, see `fp8_bits_to`)."""
    stored = cache.index_select(0, pages.flatten()).unflatten(0, pages.shape)  # [G, n, page, Hkv, D]
    stored = stored.flatten(1, 2)[:, :seq_len]  # [G, L, Hkv, D]
    if not is_fp8(cache):
        return stored.float()
    return fp8_bits_to(stored, torch.float32) * factor[:, 0]  # exactly fp8 * scale


def equal_length_batches(
    query_lens: Sequence[int], seq_lens: Sequence[int]
) -> list[tuple[tuple[int, int], list[int]]]:
    """The sequences grouped by (query_len, seq_len), in first-seen order, each group cut into calls of at
    most GROUP_CONTEXT_TOKENS context tokens (the fp32 K and V one call gathers on CPU)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for b, lengths in enumerate(zip(query_lens, seq_lens, strict=True)):
        groups.setdefault(lengths, []).append(b)
    batches = []
    for lengths, members in groups.items():
        per_call = max(1, GROUP_CONTEXT_TOKENS // lengths[1])
        batches += [(lengths, members[i : i + per_call]) for i in range(0, len(members), per_call)]
    return batches


def paged_prefill_attention(
    q: torch.Tensor,
    kv: PagedKVPages,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    sm_scale: float | None = None,
) -> torch.Tensor:
    """q `[T, Hq, D]` (T = sum(query_lens), sequence after sequence) -> `[T, Hq, D]` in q.dtype.

    Sequence b's `query_lens[b]` queries are the last tokens of its `seq_lens[b]` context, whose K/V are
    already in the pages of `block_tables[b]`; token i attends to context tokens 0..i.
    """
    _, page_size, num_kv_heads, head_dim = kv.k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q has shape {tuple(q.shape)}, expected [T, Hq, {head_dim}] with Hq a multiple of "
            f"num_kv_heads={num_kv_heads}"
        )
    num_seqs = len(query_lens)
    if len(seq_lens) != num_seqs or block_tables.shape[0] != num_seqs or sum(query_lens) != q.shape[0]:
        raise ValueError(
            f"query_lens ({num_seqs} sequences, {sum(query_lens)} tokens), seq_lens ({len(seq_lens)}), "
            f"block_tables {tuple(block_tables.shape)} and q ({q.shape[0]} tokens) must agree"
        )
    if any(not 0 < n <= length for n, length in zip(query_lens, seq_lens, strict=True)):
        raise ValueError(f"every query_len must be in [1, seq_len], got {list(query_lens)}, {list(seq_lens)}")
    sm_scale = default_sm_scale(head_dim) if sm_scale is None else sm_scale
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    k_factor, v_factor = kv.fp8_read_factors
    out = torch.empty_like(q)
    starts = [0, *itertools.accumulate(query_lens)]  # sequence b's queries: rows starts[b]..starts[b + 1]
    for (query_len, seq_len), members in equal_length_batches(query_lens, seq_lens):
        pages = block_tables[members, : -(-seq_len // page_size)].long()  # [G, n]
        k, v = (  # [G, Hkv, L, D]
            read_pages(cache, pages, seq_len, factor).to(dtype).transpose(1, 2)
            for cache, factor in ((kv.k_cache, k_factor), (kv.v_cache, v_factor))
        )
        rows = torch.cat([torch.arange(starts[b], starts[b] + query_len, device=q.device) for b in members])
        mask = None
        if query_len < seq_len:  # a cached prefix: query i sits at position seq_len - query_len + i
            positions = torch.arange(query_len, device=q.device)[:, None] + (seq_len - query_len)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= positions  # [L_q, L]
        o = F.scaled_dot_product_attention(
            q.index_select(0, rows).to(dtype).view(len(members), query_len, *q.shape[1:]).transpose(1, 2),
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=sm_scale,
            enable_gqa=True,
        )  # [G, Hq, L_q, D]
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(len(rows), *q.shape[1:]).to(out.dtype))
    return out
