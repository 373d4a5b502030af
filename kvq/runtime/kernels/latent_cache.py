"""The MLA layer cache object of the kernel contract: one layer's latent pages (and DSA indexer key pages),
checked once, and the latent store (reference and torch path; one path on every backend).

Per token and layer the pool holds one latent row `kv_c ++ k_pe` (`kv_lora_rank + qk_rope_head_dim` wide,
no heads) in bf16/fp16/fp32 or FP8 e4m3 with one `k_scale` per layer for the whole row (FP8 stores
clamp(row / k_scale, +-448) and reads fp8 * k_scale, as vLLM's MLA FP8 cache), and for GLM-5's DSA
indexer one key row of `index_head_dim` (16/32-bit, never FP8) in the same slot: pages may be strided
(`[num_pages, page_size, W]`, slot stride >= W, innermost stride 1). `slot_mapping` int64 `[T]` =
page * page_size + offset, negative = skip, as for GQA. Decode attention: `latent_attention`.
Imports torch only; the Triton launcher is imported at call time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kvq.formats.fp8_e4m3 import FP8_BITS_SCALE, fp8_bits_to
from kvq.runtime.kernels.backend import Backend, resolve_backend
from kvq.runtime.kernels.kv_cache_layout import KV_CACHE_DTYPES, is_fp8, quantize_kv
from kvq.runtime.kernels.paged_attention import PagedDecodePlan

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
class PagedLatentCache:
    """One MLA layer's latent pages, fp32 `k_scale` `[1]` and (DSA) index key pages, checked and bound
    to a backend once by `of`; per call only the new rows, queries and tables are checked."""

    latent_cache: torch.Tensor  # [num_pages, page_size, kv_lora_rank + rope]
    kv_lora_rank: int
    k_scale: torch.Tensor  # fp32 [1]
    index_keys: torch.Tensor | None  # [num_pages, page_size, index_head_dim], or None
    backend: Backend

    @classmethod
    def of(
        cls,
        latent_cache: torch.Tensor,
        kv_lora_rank: int,
        k_scale: torch.Tensor | float | None = None,
        index_keys: torch.Tensor | None = None,
        *,
        backend: str | None = None,
    ) -> PagedLatentCache:
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

    def store(
        self,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        slot_mapping: torch.Tensor,
        index_k: torch.Tensor | None = None,
    ) -> None:
        """Write rows `kv_c ++ k_pe` (`[T, R]`, `[T, rope]`) and the indexer's keys `[T, Di]` (with index
        pages) into slots `slot_mapping` `[T]`; FP8 pages quantize with k_scale."""
        store_latent(self, kv_c, k_pe, slot_mapping, index_k)

    def decode_attention(
        self,
        q: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        sm_scale: float,
        *,
        max_seq_len: int | None = None,
        plan: PagedDecodePlan | None = None,
        token_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Absorbed MLA decode: q `[B, H, R + rope]` (W_UK folded in) over the latent rows -> `[B, H, R]`
        (W_UV still to apply), softmax over each sequence's first seq_lens[b] tokens, or over the
        positions `token_indices` `[B, K]` (DSA's selection, -1 = none). See `latent_attention`."""
        if self.backend == "torch":
            from kvq.runtime.kernels.latent_attention import latent_decode_attention_torch

            return latent_decode_attention_torch(
                q, self, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len, plan=plan,
                token_indices=token_indices,
            )  # fmt: skip
        from kvq.runtime.kernels.latent_attention_triton import latent_decode_attention_triton

        return latent_decode_attention_triton(
            q, self, block_tables, seq_lens, sm_scale, max_seq_len=max_seq_len, token_indices=token_indices
        )

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


def check_new_rows(
    cache: PagedLatentCache,
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


def store_latent(
    cache: PagedLatentCache,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    index_k: torch.Tensor | None = None,
) -> None:
    """The torch path of `PagedLatentCache.store`: the reference's writes as one row copy (bytes for FP8,
    which index_copy_ has no kernel for on CPU), and the index keys likewise."""
    check_new_rows(cache, kv_c, k_pe, slot_mapping, index_k)
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:  # rare: drop the skipped tokens
        kept = (slot_mapping >= 0).nonzero().squeeze(1)
        kv_c, k_pe, slot_mapping = kv_c[kept], k_pe[kept], slot_mapping[kept]
        index_k = None if index_k is None else index_k[kept]
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    rows, stored = cache.latent_rows, torch.cat([kv_c, k_pe], dim=-1)  # [T, W]
    if is_fp8(rows):
        stored = quantize_kv(stored, rows.dtype, cache.k_scale).view(torch.uint8)
        rows = rows.view(torch.uint8)
    rows.index_copy_(0, slots, stored.to(rows.dtype))
    if index_k is not None and cache.index_rows is not None:
        cache.index_rows.index_copy_(0, slots, index_k.to(cache.index_rows.dtype))
