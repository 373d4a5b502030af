"""The GQA layer cache object of the kernel contract: one layer's K/V pages and scales, checked once.

`PagedKVCache.of` checks the pages (`kv_cache_layout`: shapes, dtype, innermost stride 1), makes the
scales fp32 `[Hkv]` and picks the backend, once; every launcher, the torch path's and Triton's alike,
then takes this object and checks only the per-call inputs (new K/V, queries, tables). The engine makes
one per attention layer through the KV pool's layout (`kvq.runtime.kv_pool`) and hands it to the layer.
Imports torch and the torch halves of the kernels; the Triton launchers are imported at call time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvq.runtime.kernels.paged.attention import PagedDecodePlan, paged_decode_attention_torch
from kvq.runtime.kernels.paged.kv_pages import PagedKVPages
from kvq.runtime.kernels.paged.kv_store import store_kv_torch
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
        With `slot_stamps` `[T]` int64 and stamped pages, each written slot's stamp too."""
        if self.backend == "torch":
            store_kv_torch(k, v, self, slot_mapping, slot_stamps)
            return
        from kvq.runtime.kernels.triton.kv_store import store_kv_triton

        store_kv_triton(k, v, self, slot_mapping, slot_stamps)

    def decode_attention(
        self,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float | None = None,
        *,
        max_seq_len: int | None = None,
        plan: PagedDecodePlan | None = None,
    ) -> torch.Tensor:
        """Decode attention of q `[B, Hq, D]` over the pages: `[B, Hq, D]` in q.dtype.

        `max_seq_len` (an upper bound of seq_lens, known to the scheduler) spares a sync; `plan` (the step's
        `plan_paged_decode`, shared by every layer) spares the torch path its index work; Triton ignores it.
        """
        if self.backend == "torch":
            return paged_decode_attention_torch(
                q, self, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len, plan=plan
            )
        from kvq.runtime.kernels.triton.paged_attention import paged_decode_attention_triton

        return paged_decode_attention_triton(
            q, self, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len
        )

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
