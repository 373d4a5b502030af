"""The GQA layer cache object of the kernel contract: one layer's K/V pages and scales, checked once.

`PagedKVCache.of` checks the pages (`kv_cache_layout`: shapes, dtype, innermost stride 1), makes the
scales fp32 `[Hkv]` and picks the backend, once; every launcher, the torch path's and Triton's alike,
then takes this object and checks only the per-call inputs (new K/V, queries, tables). The engine makes
one per attention layer through the KV pool's layout (`kvq.runtime.kv_pool`) and hands it to the layer.
`store` is the KV store's torch path (the spec: `paged.kv_store`); decode and prefill attention call the
torch halves of their kernels. Imports torch, the torch halves and kvq.runtime.kernels.integrity (slot
stamps); the Triton launchers are imported at call time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvq.runtime.kernels.integrity.stamp_check import write_stamps
from kvq.runtime.kernels.kv_cache_layout import check_new_kv, is_fp8, quantize_kv
from kvq.runtime.kernels.paged.attention import DecodeTables, paged_decode_attention_torch
from kvq.runtime.kernels.paged.kv_pages import PagedKVPages
from kvq.runtime.kernels.paged.prefill import paged_prefill_attention


@dataclass(frozen=True, eq=False)
class PagedKVCache(PagedKVPages):
    """`PagedKVPages` with the calls bound to its backend: store, decode and prefill attention."""

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        slot_stamps: torch.Tensor | None = None,
    ) -> None:
        """Write k, v `[T, Hkv, D]` into slots `slot_mapping` `[T]` (negative: skip); FP8 pages quantize.
        With `slot_stamps` `[T]` int64 and stamped pages (`self.stamps`), each written slot's stamp too.

        Triton pages: `triton.kv_store`. The torch path writes as the reference (`paged.kv_store`), with one
        `index_copy_` of K and V slot rows when the caches allow it (`kv_rows`), else one indexed write per
        cache, and the stamps by `write_stamps`; bf16 K/V on CPU: kvq's C op (`cpu_ops.store_kv`), the same
        bytes and the stamps in the same pass."""
        check_new_kv(k, v, slot_mapping, self.k_cache)
        stamps = self.stamps if slot_stamps is not None else None
        if self.backend == "triton":
            from kvq.runtime.kernels.triton.kv_store import store_kv_triton

            pair = None if stamps is None or slot_stamps is None else (stamps, slot_stamps)
            store_kv_triton(k, v, self, slot_mapping, pair)
            return
        if self.cpu_ops.store_applies(k, v, self.k_cache, slot_mapping):  # CPU bf16: one C call
            self.cpu_ops.store_kv(
                k, v, self.k_cache, self.v_cache, self.stacked_scales, slot_mapping, stamps, slot_stamps
            )
            return
        if stamps is not None and slot_stamps is not None:
            write_stamps(stamps, slot_mapping, slot_stamps)
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # rare: drop the skipped tokens
            kept = (slot_mapping >= 0).nonzero().squeeze(1)
            k, v, slot_mapping = k[kept], v[kept], slot_mapping[kept]
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        kv_rows = self.kv_rows
        if kv_rows is None:
            pages, offsets = slots // self.k_cache.shape[1], slots % self.k_cache.shape[1]
            for values, cache, scale in ((k, self.k_cache, self.k_scale), (v, self.v_cache, self.v_scale)):
                cache[pages, offsets] = quantize_kv(values, cache.dtype, scale[:, None])
            return
        stored = torch.stack([k, v])  # [2, T, Hkv, D]
        if is_fp8(self.k_cache):  # index_copy_ has no float8 kernel on CPU: copy the bytes
            stored = quantize_kv(stored, self.k_cache.dtype, self.fp8_store_scale).view(torch.uint8)
            kv_rows = kv_rows.view(torch.uint8)
        elif stored.dtype != kv_rows.dtype:
            stored = stored.to(kv_rows.dtype)
        kv_rows.index_copy_(1, slots, stored.view(2, k.shape[0], kv_rows.shape[2]))

    def decode_attention(
        self, q: torch.Tensor, tables: DecodeTables, sm_scale: float | None = None
    ) -> torch.Tensor:
        """Decode attention of q `[B, Hq, D]` over the pages, reading the step's `tables` (`DecodeTables`):
        `[B, Hq, D]` in q.dtype."""
        if self.backend == "torch":
            return paged_decode_attention_torch(q, self, tables, sm_scale)
        from kvq.runtime.kernels.triton.paged_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(q, self, tables, sm_scale)

    def prefill_attention(
        self,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        sm_scale: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens q `[T, Hq, D]` over its pages (torch SDPA on every
        backend, see `paged.prefill`): `[T, Hq, D]` in q.dtype."""
        return paged_prefill_attention(q, self, block_tables, query_lens, seq_lens, sm_scale)
