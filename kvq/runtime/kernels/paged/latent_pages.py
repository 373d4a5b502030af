"""One MLA layer's latent pages (and DSA index key pages) and its scale as the kernels read them, checked
once (`PagedLatentPages.of`): the data half of `PagedLatentCache`, which every kernel takes, so no kernel
imports the dispatcher. Layout: `paged.latent_cache`. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Self

import torch

from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE, fp8_bits_to
from kvq.runtime.kernels.backend import Backend, resolve_backend
from kvq.runtime.kernels.kv_cache_layout import KV_CACHE_DTYPES, is_fp8

INDEX_KEY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_latent_cache(
    latent_cache: torch.Tensor, kv_lora_rank: int, index_keys: torch.Tensor | None
) -> None:
    """The latent pages `[num_pages, page_size, kv_lora_rank + rope]` (and index keys `[num_pages,
    page_size, Di]` on the same pages) are ones the kernels read (ValueError/TypeError)."""
    if latent_cache.dim() != 3 or not 0 < kv_lora_rank < latent_cache.shape[2]:
        raise ValueError(
            f"latent_cache {tuple(latent_cache.shape)} must be [num_pages, page_size, kv_lora_rank + "
            f"qk_rope_head_dim] with kv_lora_rank={kv_lora_rank} < its width"
        )
    if latent_cache.dtype not in KV_CACHE_DTYPES:
        raise TypeError(f"latent_cache dtype must be one of {KV_CACHE_DTYPES}, got {latent_cache.dtype}")
    if latent_cache.stride(2) != 1 or latent_cache.stride(0) != latent_cache.shape[1] * latent_cache.stride(
        1
    ):
        raise ValueError("latent_cache must be contiguous in its rows and pages of evenly strided slots")
    if index_keys is None:
        return
    if index_keys.dim() != 3 or index_keys.shape[:2] != latent_cache.shape[:2]:
        raise ValueError(
            f"index_keys {tuple(index_keys.shape)} must be [num_pages, page_size, index_head_dim] on the "
            f"latent pages {tuple(latent_cache.shape[:2])}"
        )
    if index_keys.dtype not in INDEX_KEY_DTYPES or index_keys.device != latent_cache.device:
        raise TypeError(f"index_keys must be one of {INDEX_KEY_DTYPES} on {latent_cache.device}")
    if index_keys.stride(2) != 1 or index_keys.stride(0) != index_keys.shape[1] * index_keys.stride(1):
        raise ValueError("index_keys must be contiguous in its rows and pages of evenly strided slots")


def latent_scale(k_scale: torch.Tensor | float | None, device: torch.device) -> torch.Tensor:
    """A per-tensor `k_scale` (None = 1) as fp32 `[1]`: MLA has one scale per layer for the whole row."""
    scale = torch.as_tensor(1.0 if k_scale is None else k_scale, dtype=torch.float32, device=device)
    if scale.numel() != 1:
        raise ValueError(f"an MLA k_scale is one value per layer, got {scale.numel()} values")
    return scale.reshape(1)


@dataclass(frozen=True, eq=False)
class PagedLatentPages:
    """One MLA layer's latent pages, fp32 `k_scale` `[1]` and (DSA) index key pages, checked and bound
    to a backend once by `of`; per call only the new rows, queries and tables are checked."""

    latent_cache: torch.Tensor  # [num_pages, page_size, kv_lora_rank + rope]
    kv_lora_rank: int
    k_scale: torch.Tensor  # fp32 [1]
    index_keys: torch.Tensor | None  # [num_pages, page_size, index_head_dim], or None
    backend: Backend
    stamps: torch.Tensor | None = None  # int64 [num_slots] (stride L): the checked pool's slot stamps

    @classmethod
    def of(
        cls,
        latent_cache: torch.Tensor,
        kv_lora_rank: int,
        k_scale: torch.Tensor | float | None = None,
        index_keys: torch.Tensor | None = None,
        *,
        backend: str | None = None,
    ) -> Self:
        check_latent_cache(latent_cache, kv_lora_rank, index_keys)
        device = latent_cache.device
        return cls(
            latent_cache,
            kv_lora_rank,
            latent_scale(k_scale, device),
            index_keys,
            resolve_backend(device, backend),
        )

    @property
    def page_size(self) -> int:
        return self.latent_cache.shape[1]

    @cached_property
    def latent_rows(self) -> torch.Tensor:
        """`[num_pages * page_size, W]`: one row per slot (a view)."""
        return self.latent_cache.flatten(0, 1)

    @cached_property
    def index_rows(self) -> torch.Tensor | None:
        return None if self.index_keys is None else self.index_keys.flatten(0, 1)

    @cached_property
    def fp8_read_factor(self) -> torch.Tensor:
        """fp32 `[1]`: k_scale * 2^120, turning `fp8_bits_to` output into values."""
        return self.k_scale * FP8_BITS_SCALE

    def read(self, pages: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sequence's first `seq_len` latent rows as fp32 values `[L, W]` from its `pages` `[n]`, and its
        index keys `[L, Di]` (None without index pages), for prefill."""
        slots = (
            pages[:, None] * self.page_size + torch.arange(self.page_size, device=pages.device)
        ).flatten()
        slots = slots[:seq_len]
        rows = self.latent_rows.index_select(0, slots)
        values = fp8_bits_to(rows, torch.float32) * self.fp8_read_factor if is_fp8(rows) else rows.float()
        index_rows = self.index_rows
        return values, None if index_rows is None else index_rows.index_select(0, slots)
