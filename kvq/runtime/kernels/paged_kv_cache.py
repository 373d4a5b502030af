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
from functools import cached_property

import torch

from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE
from kvq.runtime.kernels.backend import Backend, resolve_backend
from kvq.runtime.kernels.kv_cache_layout import check_kv_cache, kv_slot_rows, per_head_scale
from kvq.runtime.kernels.kv_store import store_kv_torch
from kvq.runtime.kernels.paged_attention import PagedDecodePlan, paged_decode_attention_torch
from kvq.runtime.kernels.paged_prefill import paged_prefill_attention


@dataclass(frozen=True, eq=False)
class PagedKVCache:
    """One layer's paged K/V (layout: `kv_cache_layout`) and fp32 per-head scales `[Hkv]`, checked and
    bound to a backend once by `of`: the per-token calls below check only their own inputs and the torch
    path derives its views once (at batch 1, such per-call costs are most of a decode step's attention)."""

    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor  # fp32 [Hkv] (an expanded view, stride 0, for a per-tensor scale)
    v_scale: torch.Tensor
    backend: Backend

    @classmethod
    def of(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        *,
        backend: str | None = None,
    ) -> PagedKVCache:
        """Check the caches, make scales (per tensor or per head; None = 1) fp32 `[Hkv]`, pick the backend."""
        _, num_kv_heads, _ = check_kv_cache(k_cache, v_cache)
        return cls(
            k_cache,
            v_cache,
            per_head_scale(k_scale, num_kv_heads, k_cache.device, "k_scale"),
            per_head_scale(v_scale, num_kv_heads, k_cache.device, "v_scale"),
            resolve_backend(k_cache.device, backend),
        )

    @cached_property
    def kv_rows(self) -> torch.Tensor | None:
        """The torch path's `kv_slot_rows` `[2, num_slots, Hkv * D]`: K and V moved with one op, or None."""
        return kv_slot_rows(self.k_cache, self.v_cache)

    @cached_property
    def fp8_store_scale(self) -> torch.Tensor:
        """fp32 `[2, 1, Hkv, 1]`: K and V stacked `[2, T, Hkv, D]` divided by this are FP8 pages' values."""
        return torch.stack([self.k_scale, self.v_scale])[:, None, :, None]

    @cached_property
    def fp8_read_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `[Hkv, 1, 1]` for K and V: scale * 2^120, turning `fp8_bits_to` output into values."""
        k_factor, v_factor = torch.stack([self.k_scale, self.v_scale])[:, :, None, None] * FP8_BITS_SCALE
        return k_factor, v_factor

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write k, v `[T, Hkv, D]` into slots `slot_mapping` `[T]` (negative: skip); FP8 pages quantize."""
        if self.backend == "torch":
            store_kv_torch(k, v, self, slot_mapping)
            return
        from kvq.runtime.kernels.kv_store_triton import store_kv_triton

        store_kv_triton(k, v, self, slot_mapping)

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
        from kvq.runtime.kernels.paged_attention_triton import paged_decode_attention_triton

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
        backend, see `paged_prefill`): `[T, Hq, D]` in q.dtype."""
        return paged_prefill_attention(q, self, block_tables, query_lens, seq_lens, sm_scale)
