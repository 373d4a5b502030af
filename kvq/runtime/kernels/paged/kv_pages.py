"""One layer's GQA pages and scales as the kernels read them, checked once (`PagedKVPages.of`): the data
half of `PagedKVCache`, which every kernel (torch and Triton) takes, so no kernel imports the dispatcher.
Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Self

import torch

from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE
from kvq.runtime.kernels.backend import Backend, resolve_backend
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.kv_cache_layout import check_kv_cache, kv_slot_rows, per_head_scale


@dataclass(frozen=True, eq=False)
class PagedKVPages:
    """One layer's paged K/V (layout: `kv_cache_layout`) and fp32 per-head scales `[Hkv]`, checked and
    bound to a backend once by `of`: the per-token calls below check only their own inputs and the torch
    path derives its views once (at batch 1, such per-call costs are most of a decode step's attention)."""

    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor  # fp32 [Hkv] (an expanded view, stride 0, for a per-tensor scale)
    v_scale: torch.Tensor
    backend: Backend
    cpu_ops: CpuOps  # on CPU, the engine's C ops (the store and decode attention where they apply)
    stamps: torch.Tensor | None = None  # int64 [num_slots] (stride L): the checked pool's slot stamps

    @classmethod
    def of(
        cls,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        *,
        backend: str | None = None,
        cpu_ops: CpuOps | None = None,
    ) -> Self:
        """Check the caches, make scales (per tensor or per head; None = 1) fp32 `[Hkv]`, pick the backend
        (and the CPU kernels: None, `CpuOps.choose()`; a layer binds its engine's, `PagedAttention.bind`)."""
        _, num_kv_heads, _ = check_kv_cache(k_cache, v_cache)
        return cls(
            k_cache,
            v_cache,
            per_head_scale(k_scale, num_kv_heads, k_cache.device, "k_scale"),
            per_head_scale(v_scale, num_kv_heads, k_cache.device, "v_scale"),
            resolve_backend(k_cache.device, backend),
            CpuOps.choose() if cpu_ops is None else cpu_ops,
        )

    @cached_property
    def kv_rows(self) -> torch.Tensor | None:
        """The torch path's `kv_slot_rows` `[2, num_slots, Hkv * D]`: K and V moved with one op, or None."""
        return kv_slot_rows(self.k_cache, self.v_cache)

    @cached_property
    def stacked_scales(self) -> torch.Tensor:
        """fp32 contiguous `[2, Hkv]`: k_scale, v_scale (the native CPU attention reads it by address)."""
        return torch.stack([self.k_scale, self.v_scale]).contiguous()

    @cached_property
    def fp8_store_scale(self) -> torch.Tensor:
        """fp32 `[2, 1, Hkv, 1]`: K and V stacked `[2, T, Hkv, D]` divided by this are FP8 pages' values."""
        return self.stacked_scales[:, None, :, None]

    @cached_property
    def fp8_read_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `[Hkv, 1, 1]` for K and V: scale * 2^120, turning `fp8_bits_to` output into values."""
        k_factor, v_factor = torch.stack([self.k_scale, self.v_scale])[:, :, None, None] * FP8_BITS_SCALE
        return k_factor, v_factor
