"""The MLA layer cache object of the kernel contract: one layer's latent pages (and DSA indexer key pages),
checked once, and the latent store (reference and torch path; one path on every backend).

Per token and layer the pool holds one latent row `kv_c ++ k_pe` (`kv_lora_rank + qk_rope_head_dim` wide,
no heads) in bf16/fp16/fp32 or FP8 e4m3 with one `k_scale` per layer for the whole row (FP8 stores
clamp(row / k_scale, +-448) and reads fp8 * k_scale, as vLLM's MLA FP8 cache), and for GLM-5's DSA
indexer one key row of `index_head_dim` (16/32-bit, never FP8) in the same slot: pages may be strided
(`[num_pages, page_size, W]`, slot stride >= W, innermost stride 1). `slot_mapping` int64 `[T]` =
page * page_size + offset, negative = skip, as for GQA. Decode attention: `paged.latent_attention`.
Imports torch and kvq.runtime.kernels.integrity (slot stamps); the Triton launcher is imported at call time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.runtime.kernels.integrity.stamp_check import write_stamps
from kvq.runtime.kernels.kv_cache_layout import is_fp8, quantize_kv
from kvq.runtime.kernels.paged.attention import DecodeTables
from kvq.runtime.kernels.paged.latent_pages import PagedLatentPages, latent_scale


def check_new_rows(
    cache: PagedLatentPages,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    index_k: torch.Tensor | None,
) -> None:
    """The new rows against a checked cache (ValueError/TypeError)."""
    num_tokens, width = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1, cache.latent_cache.shape[2]
    rank = cache.kv_lora_rank
    if kv_c.shape != (num_tokens, rank) or k_pe.shape != (num_tokens, width - rank):
        raise ValueError(
            f"kv_c {tuple(kv_c.shape)}, k_pe {tuple(k_pe.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} must be [T, {rank}], [T, {width - rank}] and [T]"
        )
    if (index_k is None) != (cache.index_keys is None):
        raise ValueError("index_k is given exactly when the cache has index pages (a DSA layer)")
    if (
        index_k is not None
        and cache.index_keys is not None
        and index_k.shape != (num_tokens, cache.index_keys.shape[2])
    ):
        raise ValueError(f"index_k {tuple(index_k.shape)} must be [T, {cache.index_keys.shape[2]}]")
    if slot_mapping.is_floating_point() or not kv_c.is_floating_point():
        raise TypeError(
            f"slot_mapping must be integer and kv_c float, got {slot_mapping.dtype}, {kv_c.dtype}"
        )
    if not (kv_c.device == k_pe.device == slot_mapping.device == cache.latent_cache.device):
        raise ValueError("kv_c, k_pe, slot_mapping and the cache must share a device")


def store_latent_reference(
    latent_cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
) -> None:
    """The spec, in place: `latent_cache[slot // page_size, slot % page_size] = quantize(kv_c ++ k_pe)` for
    every slot >= 0 (FP8: clamp(row / k_scale, +-448) rounded to e4m3)."""
    page_size = latent_cache.shape[1]
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid].long()
    row = torch.cat([kv_c, k_pe], dim=-1)[is_valid]
    latent_cache[slots // page_size, slots % page_size] = quantize_kv(
        row, latent_cache.dtype, latent_scale(k_scale, latent_cache.device)
    )


@dataclass(frozen=True, eq=False)
class PagedLatentCache(PagedLatentPages):
    """`PagedLatentPages` with the calls bound to its backend: store and decode attention."""

    def store(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        index_k: torch.Tensor | None = None,
        slot_stamps: torch.Tensor | None = None,
    ) -> None:
        """Write rows `kv_c ++ k_pe` (`[T, R]`, `[T, rope]`) and the indexer's keys `[T, Di]` (with index
        pages) into slots `slot_mapping` `[T]` (negative: skip); FP8 pages quantize with k_scale. With
        `slot_stamps` `[T]` int64 and stamped pages, each written slot's stamp too. One torch path on every
        backend: the reference's writes as one row copy (bytes for FP8, which index_copy_ has no kernel for
        on CPU), the index keys likewise, and the slot stamps."""
        check_new_rows(self, kv_c, k_pe, slot_mapping, index_k)
        if self.stamps is not None and slot_stamps is not None:
            write_stamps(self.stamps, slot_mapping, slot_stamps)
        if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # rare: drop the skipped tokens
            kept = (slot_mapping >= 0).nonzero().squeeze(1)
            kv_c, k_pe, slot_mapping = kv_c[kept], k_pe[kept], slot_mapping[kept]
            index_k = None if index_k is None else index_k[kept]
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        rows, stored = self.latent_rows, torch.cat([kv_c, k_pe], dim=-1)  # [T, W]
        if is_fp8(rows):
            stored = quantize_kv(stored, rows.dtype, self.k_scale).view(torch.uint8)
            rows = rows.view(torch.uint8)
        rows.index_copy_(0, slots, stored.to(rows.dtype))
        if index_k is not None and self.index_rows is not None:
            self.index_rows.index_copy_(0, slots, index_k.to(self.index_rows.dtype))

    def decode_attention(self, q: torch.Tensor, tables: DecodeTables, sm_scale: float) -> torch.Tensor:
        """Absorbed MLA decode: q `[B, H, R + rope]` (W_UK folded in) over the latent rows -> `[B, H, R]`
        (W_UV still to apply), softmax over each sequence's first seq_lens[b] tokens, or over the positions
        `tables.token_indices` `[B, K]` (DSA's selection, -1 = none). See `paged.latent_attention`."""
        if self.backend == "torch":
            from kvq.runtime.kernels.paged.latent_attention import latent_decode_attention_torch

            return latent_decode_attention_torch(q, self, tables, sm_scale)
        from kvq.runtime.kernels.triton.latent_attention import latent_decode_attention_triton

        return latent_decode_attention_triton(q, self, tables, sm_scale)
