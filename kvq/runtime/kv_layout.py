"""What a token slot of the paged KV pool holds in each layer, one class per cache layout.

A layout is (the per-layer cache object the kernels take, the bytes of one token slot, how the pool's
storage is allocated). `KVPool` holds the storage of any layout and the block manager only counts
pages, so a layout plugs in without either knowing it. Storage is one tensor `[L, C, P + 1, page_size,
...]`: C parts per slot (GQA: K and V), laid out so that `[L, C, P + 1, page_size * row_bytes]` views
its bytes (the checked pool's sampled-bytes hash reads pages through that view).
Imports torch and kvq.runtime.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvq.runtime.kernels import PagedKVCache
from kvq.runtime.kernels.kv_cache_layout import per_head_scale

Scales = dict[str, torch.Tensor | None]  # a layer's checkpoint scales by name ("k_scale", "v_scale")


class KVLayout(Protocol):
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the cached values (FP8 pages need the checkpoint's scales)."""
        ...

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The per-layer checkpoint scales FP8 pages of this layout are read and written with."""
        ...

    @property
    def num_parts(self) -> int:
        """C: rows each token slot has per layer (GQA: K and V)."""
        ...

    @property
    def row_bytes(self) -> int:
        """Bytes of one part of one token slot in one layer."""
        ...

    def allocate(self, num_layers: int, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        """Uninitialized storage `[L, C, num_pages, page_size, ...]` (`num_pages` counts the zero page)."""
        ...

    def layer_cache(self, storage: torch.Tensor, scales: Scales) -> object:
        """The cache object of one layer over its `storage[layer]`, with scales (None: 1.0) made ready."""
        ...


def slot_bytes(layout: KVLayout) -> int:
    """Bytes one token slot takes in one layer, every part."""
    return layout.num_parts * layout.row_bytes


@dataclass(frozen=True)
class GqaLayout:
    """Post-RoPE K and V per KV head (llama, glm4_moe): `PagedKVCache` per layer, scales per tensor or
    per head."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale_names: tuple[str, ...] = ("k_scale", "v_scale")
    num_parts: int = 2

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, num_layers: int, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        # K and V side by side in one tensor per layer, so the torch path stores and gathers both with one
        # op (`kv_cache_layout.kv_slot_rows`)
        shape = (num_layers, 2, num_pages, page_size, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=device)  # [L, 2, P + 1, page_size, Hkv, D]

    def layer_cache(self, storage: torch.Tensor, scales: Scales) -> PagedKVCache:
        k_scale, v_scale = (
            per_head_scale(_float(scales.get(name)), self.num_kv_heads, storage.device, name).contiguous()
            for name in self.scale_names
        )
        return PagedKVCache.of(storage[0], storage[1], k_scale, v_scale)


def _float(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.float()
