"""Paged attention over the KV pool: store the step's K/V into its page slots, then attend.

Every device goes through `kvq.runtime.kernels`: the layer's `PagedKVCache`, which the engine makes
through the KV pool and hands to the layer (`bind`), carries the backend choice (Triton on CUDA, torch on
CPU, or $KVQ_KERNELS) and, bound here, the engine's CPU kernels (`CpuOps`). Prefill reads each sequence's
whole context back from its pages, so a prefix hit and a fresh prefill see the same K/V.
Imports torch and kvq.runtime.kernels.
"""

from __future__ import annotations

import torch

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels import CpuOps, PagedKVCache


class PagedAttention:
    """Attention of one layer over its pages (bound to the KV pool by the engine)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: CpuOps) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale, self.ops = head_dim**-0.5, ops
        unbound = torch.empty(0, 1, num_kv_heads, head_dim)  # no pages until `bind`
        self.kv = PagedKVCache.of(unbound, unbound, cpu_ops=ops)

    @property
    def k_scale(self) -> torch.Tensor:
        return self.kv.k_scale

    @property
    def v_scale(self) -> torch.Tensor:
        return self.kv.v_scale

    def bind(self, kv: PagedKVCache) -> None:
        """This layer's pages and scales, from the engine's KV pool (bound to the engine's kernels)."""
        self.kv = kv

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]` in q.dtype."""
        kv = self.kv
        kv.store(k, v, batch.slot_mapping, batch.slot_stamps)
        if batch.is_prefill:
            return kv.prefill_attention(
                q, batch.block_tables, batch.query_lens, batch.context_lens_list, self.sm_scale
            )
        return kv.decode_attention(q, batch.decode_tables(kv.backend), self.sm_scale)
