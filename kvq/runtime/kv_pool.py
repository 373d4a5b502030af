"""The KV pool: the paged memory of every layer for one cache layout (`kv_layout`: GQA K/V pages, ...),
sized from a byte budget, and the per-layer cache objects over it that the engine hands to the layers.
Which request owns which page is the block manager's business; this file only holds the memory and the
scales (FP8 pages need the checkpoint's: missing ones are an error or a loud warning and 1.0), and, for a
checked pool only (--kv-integrity tags/full), each slot's integrity stamps (8 bytes per slot and layer,
counted in `page_bytes` and in `kvq plan` then; `off` holds no stamp byte).
Imports torch, kvq.errors and kvq.runtime.kv_layout.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvq.checkpoint.kv_cache_spec import SLOT_STAMP_BYTES
from kvq.errors import KvqError
from kvq.runtime.kernels import CpuOps
from kvq.runtime.kv_layout import KVLayout, Scales, slot_bytes

logger = logging.getLogger("kvq")


STAMP_BYTES = SLOT_STAMP_BYTES  # per slot and layer: the int64 slot stamp (`kernels.integrity.stamp_check`)


def page_bytes(layout: KVLayout, num_layers: int, page_size: int, is_checked: bool = False) -> int:
    """Bytes one page takes over all layers, every part of every slot, and, in a checked pool, the slots'
    stamps."""
    return num_layers * page_size * (slot_bytes(layout) + (STAMP_BYTES if is_checked else 0))


class KVPool:
    def __init__(
        self,
        layout: KVLayout,
        num_layers: int,
        num_pages: int,
        page_size: int,
        device: torch.device,
        is_checked: bool = False,
        *,
        backend: str | None = None,
        cpu_ops: CpuOps | None = None,
    ) -> None:
        """`backend` and `cpu_ops`: the engine's kernels, which every layer's cache object carries (None:
        chosen when the caches are made, `resolve_backend` / `CpuOps.choose`)."""
        if num_pages < 1:
            raise KvqError(
                f"the KV budget holds no page of {page_size} tokens "
                f"({page_bytes(layout, num_layers, page_size, is_checked)} bytes each); raise --kv-memory"
            )
        self.layout, self.num_layers = layout, num_layers
        self.backend, self.cpu_ops = backend, cpu_ops
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, layout.dtype
        # One more page than handed out: `zero_page`, all zeros, which attention reads for slots past a
        # sequence's end. The others start empty (committed as written; read once written). All layers
        # are views of one `storage` tensor, so one gather reaches a page in every layer
        # (`page_bytes_view`, the integrity check's sampled-bytes hash).
        self.zero_page = num_pages
        self.storage = layout.allocate(num_layers, num_pages + 1, page_size, device)  # [L, C, P + 1, ...]
        self.storage[:, :, self.zero_page].zero_()
        # A checked pool's stamps: each slot's in every layer, side by side (`kernels.integrity.stamp_check`),
        # written with the K/V by the stores. None with --kv-integrity off: no byte, and the stores skip them.
        self.stamps: torch.Tensor | None = None  # [P + 1, page_size, L] int64
        self.caches: list = []  # per layer, made by `layer_caches`
        self._scales: list[Scales] = []
        self._layers: list = []  # what `bind` handed the caches to (`set_checked` hands them new ones)
        self.set_checked(is_checked)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def is_checked(self) -> bool:
        """True when the pool holds slot stamps (--kv-integrity tags/full)."""
        return self.stamps is not None

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds: every page's (the zero page included) storage and stamps."""
        stamps = 0 if self.stamps is None else self.stamps.numel() * self.stamps.element_size()
        return self.storage.numel() * self.storage.element_size() + stamps

    def set_checked(self, is_checked: bool) -> None:
        """Give the pool slot stamps (zeros: no writer's stamp) or take them away, and hand every bound layer
        its cache object anew (a new object: decode plans made over the old one are remade). A switch to a
        checked mode adds `STAMP_BYTES` per slot and layer beyond the pages' budget."""
        if is_checked == self.is_checked:
            return
        num_slot_pages, page_size = self.storage.shape[2:4]
        shape = (num_slot_pages, page_size, self.num_layers)
        self.stamps = torch.zeros(shape, dtype=torch.int64, device=self.device) if is_checked else None
        if self.caches:
            self._make_caches()

    def bind(self, layers: list) -> None:
        """Hand each layer its cache object (`layer.bind_kv`), now and whenever `set_checked` remakes them."""
        if len(layers) != len(self.caches):
            raise ValueError(f"{len(layers)} layers for {len(self.caches)} caches; call layer_caches first")
        self._layers = list(layers)
        for layer, cache in zip(self._layers, self.caches, strict=True):
            layer.bind_kv(cache)

    @property
    def row_bytes(self) -> int:
        """Bytes of one part (GQA: K, or V) of one token slot in one layer."""
        return self.layout.row_bytes

    def page_bytes_view(self) -> torch.Tensor:
        """The pool's bytes as `[L, C, num_pages + 1, page_size * row_bytes]` uint8 (a view, no copy)."""
        num_layers, num_parts, num_slot_pages = self.storage.shape[:3]
        return self.storage.view(torch.uint8).view(num_layers, num_parts, num_slot_pages, -1)

    def layer_caches(self, scales: list[Scales], *, require_kv_scales: bool, where: str) -> list:
        """Each layer's cache object over its pages, with its scales (`scales[i]`: the checkpoint's, by
        name); also kept as `caches`. FP8 pages need the layout's scales: missing ones are an error with
        `require_kv_scales`, else a loud warning and 1.0."""
        names = self.layout.scale_names
        missing = [i for i, s in enumerate(scales) if any(s.get(name) is None for name in names)]
        if self.dtype == torch.float8_e4m3fn and missing:
            message = (
                f"{where}: FP8 KV cache but no {'/'.join(names)} for {len(missing)} of {len(scales)} "
                f"layers (first: model.layers.{missing[0]}.self_attn.{names[0]})"
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
        if len(scales) != self.num_layers:
            raise ValueError(f"{len(scales)} layers' scales for a pool of {self.num_layers} layers")
        self._scales = list(scales)
        self._make_caches()
        return self.caches

    def _make_caches(self) -> None:
        stamps = None if self.stamps is None else self.stamps.view(-1, self.num_layers)  # [num_slots, L]
        self.caches = [
            replace(  # type: ignore[type-var]
                self.layout.layer_cache(self.storage[i], s, self.backend, self.cpu_ops),
                stamps=None if stamps is None else stamps[:, i],
            )
            for i, s in enumerate(self._scales)
        ]
        for layer, cache in zip(self._layers, self.caches, strict=False):  # none before `bind`
            layer.bind_kv(cache)
