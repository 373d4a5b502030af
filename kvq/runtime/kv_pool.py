"""The KV pool: per-layer K and V page tensors `[num_pages, page_size, num_kv_heads, head_dim]` (BF16 or
FP8 e4m3 with the checkpoint's k/v scales), sized from a byte budget. Which request owns which page is
the block manager's business; this file only holds the memory and the scales.
Imports torch, kvq.errors and kvq.runtime.layers.attention.
"""

from __future__ import annotations

import logging

import torch

from kvq.errors import KvqError
from kvq.runtime.kernels.kv_cache_layout import per_head_scale
from kvq.runtime.layers.attention import PagedAttention

logger = logging.getLogger("kvq")


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers, K and V."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_pages < 1:
            raise KvqError(
                f"the KV budget holds no page of {page_size} tokens "
                f"({page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)} bytes each); "
                "raise --kv-memory"
            )
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        # Per layer one tensor `[2, num_pages + 1, page_size, Hkv, D]`: K and V side by side, so the torch
        # path stores and gathers both with one op; `k_caches[i]`, `v_caches[i]` are its halves (the
        # kernels' layout). One more page than handed out: `zero_page`, all zeros, which attention reads for
        # slots past a sequence's end. The others start empty (committed as written; read once written).
        # All layers are views of one `storage` tensor, so one gather reaches a page in every layer
        # (`page_bytes_view`, the integrity check's sampled-bytes hash).
        self.zero_page = num_pages
        self.storage = torch.empty(
            (num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )  # [L, 2, P + 1, page_size, Hkv, D]
        self.storage[:, :, self.zero_page].zero_()
        self.kv_caches = list(self.storage.unbind(0))
        self.k_caches = [kv_cache[0] for kv_cache in self.kv_caches]
        self.v_caches = [kv_cache[1] for kv_cache in self.kv_caches]

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_pages: int | None = None,
    ) -> KVPool:
        """As many pages as `budget_bytes` holds (at most `max_pages`)."""
        num_pages = budget_bytes // page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)
        if max_pages is not None:
            num_pages = min(num_pages, max_pages)
        return cls(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def row_bytes(self) -> int:
        """Bytes of one token slot's K (or V) in one layer: Hkv * D * itemsize."""
        return self.storage[0, 0, 0, 0].numel() * self.dtype.itemsize

    def page_bytes_view(self) -> torch.Tensor:
        """The pool's bytes as `[L, 2, num_pages + 1, page_size * row_bytes]` uint8 (a view, no copy)."""
        num_layers, _, num_slots_pages = self.storage.shape[:3]
        return self.storage.view(torch.uint8).view(num_layers, 2, num_slots_pages, -1)

    def bind(
        self,
        layers: list[PagedAttention],
        scales: list[tuple[torch.Tensor | None, torch.Tensor | None]],
        *,
        require_kv_scales: bool,
        where: str,
    ) -> None:
        """Give each attention layer its pages and fp32 scales; FP8 pages need the checkpoint's scales.

        Missing scales with FP8 pages: an error with `require_kv_scales`, else a loud warning and 1.0.
        """
        is_fp8 = self.dtype == torch.float8_e4m3fn
        missing = [i for i, (k, v) in enumerate(scales) if k is None or v is None]
        if is_fp8 and missing:
            message = (
                f"{where}: FP8 KV cache but no k_scale/v_scale for {len(missing)} of {len(scales)} layers "
                f"(first: model.layers.{missing[0]}.self_attn.k_scale)"
            )
            if require_kv_scales:
                raise KvqError(
                    message + "; run `kvq calibrate` on the checkpoint or use --kv-cache-dtype bf16"
                )
            logger.warning(
                "WARNING: %s; using scale 1.0, which can cost accuracy. Run `kvq calibrate` "
                "to measure scales.",
                message,
            )
        for i, (layer, (k_scale, v_scale)) in enumerate(zip(layers, scales, strict=True)):
            k_s, v_s = (self._scale(s, layer.num_kv_heads) for s in (k_scale, v_scale))
            layer.bind(self.kv_caches[i], k_s, v_s)

    def _scale(self, scale: torch.Tensor | None, num_kv_heads: int) -> torch.Tensor:
        device = self.k_caches[0].device
        values = per_head_scale(None if scale is None else scale.float(), num_kv_heads, device, "kv scale")
        return values.contiguous()
