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

from kvq.checkpoint.kv_cache_spec import KvCacheSpec, heads_per_rank
from kvq.errors import KvqError
from kvq.runtime.kernels import CpuOps, PagedKVCache
from kvq.runtime.kernels.kv_cache_layout import per_head_scale
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache

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

    def layer_cache(
        self, storage: torch.Tensor, scales: Scales, backend: str | None, cpu_ops: CpuOps | None
    ) -> object:
        """The cache object of one layer over its `storage[layer]`, with scales (None: 1.0) made ready, for
        the engine's kernels (None: chosen now)."""
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

    def layer_cache(
        self, storage: torch.Tensor, scales: Scales, backend: str | None, cpu_ops: CpuOps | None
    ) -> PagedKVCache:
        k_scale, v_scale = (
            per_head_scale(_float(scales.get(name)), self.num_kv_heads, storage.device, name).contiguous()
            for name in self.scale_names
        )
        return PagedKVCache.of(storage[0], storage[1], k_scale, v_scale, backend=backend, cpu_ops=cpu_ops)


def _float(scale: torch.Tensor | None) -> torch.Tensor | None:
    return None if scale is None else scale.float()


@dataclass(frozen=True)
class LatentLayout:
    """MLA (deepseek_v3, kimi_k2, glm_moe_dsa): one latent row `kv_c ++ k_pe` per token and layer, no
    heads, FP8 with one `k_scale` per layer (vLLM reads only `k_scale` for MLA); GLM-5's DSA indexer
    keeps its key row (`index_head_dim`, 16/32-bit) in the same slot, after the latent, so its pages are
    the latent's pages and the checked pool's tags and sampled bytes cover both. Storage is bytes
    `[L, 1, P + 1, page_size, row_bytes]`, viewed per layer as the two strided tensors."""

    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype
    index_head_dim: int = 0
    index_dtype: torch.dtype = torch.bfloat16
    scale_names: tuple[str, ...] = ("k_scale",)
    num_parts: int = 1

    @property
    def latent_bytes(self) -> int:
        return (self.kv_lora_rank + self.rope_dim) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return self.latent_bytes + self.index_head_dim * self.index_dtype.itemsize

    def allocate(self, num_layers: int, num_pages: int, page_size: int, device: torch.device) -> torch.Tensor:
        sizes = (self.dtype.itemsize, self.index_dtype.itemsize if self.index_head_dim else 1)
        if self.row_bytes % max(sizes) or self.latent_bytes % sizes[1]:
            raise ValueError(f"{self} does not align its rows for {self.dtype} and {self.index_dtype} views")
        shape = (num_layers, 1, num_pages, page_size, self.row_bytes)
        return torch.empty(shape, dtype=torch.uint8, device=device)  # [L, 1, P + 1, page_size, row_bytes]

    def views(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's `storage[layer]` `[1, P + 1, page_size, row_bytes]` as latent pages `[P + 1,
        page_size, R + rope]` and index key pages `[P + 1, page_size, Di]` (None without an indexer)."""
        slots = storage[0]
        latent = slots[..., : self.latent_bytes].view(self.dtype)
        if not self.index_head_dim:
            return latent, None
        return latent, slots[..., self.latent_bytes :].view(self.index_dtype)

    def layer_cache(
        self, storage: torch.Tensor, scales: Scales, backend: str | None, cpu_ops: CpuOps | None
    ) -> PagedLatentCache:
        latent, index_keys = self.views(storage)
        k_scale = scales.get("k_scale")
        if k_scale is not None and k_scale.numel() != 1:
            raise KvqError(
                f"an MLA k_scale has {k_scale.numel()} values (shape {tuple(k_scale.shape)}); the latent row "
                "has no heads, so it takes one value per layer (kv_cache_scheme strategy tensor): "
                "re-run `kvq calibrate` on the checkpoint"
            )
        return PagedLatentCache.of(latent, self.kv_lora_rank, _float(k_scale), index_keys, backend=backend)


def layout_for(spec: KvCacheSpec, dtype: torch.dtype, tp: int = 1) -> GqaLayout | LatentLayout:
    """The pool layout of a model's KV cache spec (`kvq.checkpoint.kv_cache_spec`, the one `kvq plan` sizes
    from, so bytes per token agree) on one of `tp` ranks (GQA: its heads; MLA: the whole latent) with
    values in `dtype`; DSA index keys in bf16 (fp32 with fp32 pages)."""
    if not spec.is_mla:
        return GqaLayout(heads_per_rank(spec, tp), spec.head_dim, dtype)
    index_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    return LatentLayout(spec.kv_lora_rank, spec.qk_rope_head_dim, dtype, spec.index_head_dim, index_dtype)
