"""Paged attention over the KV pool: store the step's K/V into its page slots, then attend.

On the Triton backend both go through `kvq.runtime.kernels` (`store_kv`, `paged_decode_attention`).
The torch path (CPU) is here and batched, with the kernels' references as its spec (tests compare
them): the kernels' torch references loop over sequences and re-derive scales per call, ~10x slower
per decode step at batch 64. Prefill reads each sequence's whole context back from its pages, so a
prefix hit and a fresh prefill see the same K/V. Imports torch and kvq.runtime.kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvq.runtime.batch import ForwardBatch
from kvq.runtime.kernels import paged_decode_attention, resolve_backend, store_kv
from kvq.runtime.kernels.kv_cache_layout import FP8_E4M3_MAX

_SMALL_ATTENTION = 1024  # decode batch x context slots below which fp32 matmuls are the fastest on CPU
_E4M3_EXPONENT_OFFSET = 2.0**120  # e4m3 bits moved into a bf16 / fp32 read 2^(127 - 7) too small
# (int type, shift, mask) moving e4m3 bits into a float of that width: the int8 sign-extended and shifted
# puts the sign in the top bit and exponent + mantissa right below the float's exponent/mantissa border;
# the mask (0x87F0, 0x87F00000) clears the sign's other copies.
_FP8_BIT_MOVES = {torch.bfloat16: (torch.int16, 4, -30736), torch.float32: (torch.int32, 20, -2014314496)}


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without a dispatch when it already is (a no-op `.to` still costs ~1 us on CPU)."""
    return x if x.dtype == dtype else x.to(dtype)


def fp8_bits_to(pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 values -> (value * 2^-120) in bf16 or fp32, exactly (subnormals included), by moving bits: 2-4x
    faster than torch's fp8 conversion on CPU. Multiply by scale * 2^120 (`fp8_factor`) for the real value."""
    int_dtype, shift, mask = _FP8_BIT_MOVES[dtype]
    return ((pages.view(torch.int8).to(int_dtype) << shift) & mask).view(dtype)


def fp8_factor(scale: torch.Tensor) -> torch.Tensor:
    """scale * 2^120 (fp32): turns `fp8_bits_to` output into the real K or V value."""
    return scale.float() * _E4M3_EXPONENT_OFFSET


def quantize_pages(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V `[T, Hkv, D]` as stored in pages of `dtype`: FP8 = clamp(x / scale, +-448)."""
    if dtype != torch.float8_e4m3fn:
        return cast(values, dtype)
    return (values.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


class PagedAttention:
    """softmax(q k^T * sm_scale) v for one layer; `bind` gives it its pages and scales (see `KVPool`)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = head_dim**-0.5
        self.kv_cache = self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = torch.ones(num_kv_heads)
        self.is_triton = False

    def bind(self, kv_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Pages `[2, num_pages, page_size, Hkv, D]` (K, V) and fp32 scales `[Hkv]` (FP8 pages only)."""
        self.kv_cache, self.k_cache, self.v_cache = kv_cache, kv_cache[0], kv_cache[1]
        self.k_scale, self.v_scale = k_scale, v_scale
        self.is_triton = resolve_backend(kv_cache.device) == "triton"
        self.is_fp8 = kv_cache.dtype == torch.float8_e4m3fn
        self._slots = kv_cache.view(2, -1, self.num_kv_heads * self.head_dim)  # one row per slot
        scales = torch.stack([k_scale, v_scale]).float()  # [2, Hkv]
        self._store_scale = scales[:, None, :, None]  # [2, 1, Hkv, 1]: over stored K/V [2, T, Hkv, D]
        # FP8 pages are read as bits moved (value * 2^-120); the scale * 2^120 factor is applied to the
        # (small) query for K and to the output for V instead of to every K/V element: [Hkv, 1, 1]
        self._factors = fp8_factor(scales)[:, :, None, None]  # [2, Hkv, 1, 1]

    def _store_torch(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """K and V `[T, Hkv, D]` into their slots, both with one op (FP8: quantized with the scales)."""
        kv = quantize_pages(torch.stack([k, v]), self._store_scale, self.kv_cache.dtype)  # [2, T, Hkv, D]
        kv = kv.view(2, -1, self.num_kv_heads * self.head_dim)
        if self.is_fp8:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            self._slots.view(torch.uint8).index_copy_(1, slot_mapping, kv.view(torch.uint8))
        else:
            self._slots.index_copy_(1, slot_mapping, kv)

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """K and V at `slots` `[B, C]` (past an end: the zero page) as stored: `[2, B, C, Hkv, D]`."""
        kv = self._slots.index_select(1, slots.flatten())
        return kv.view(2, *slots.shape, self.num_kv_heads, self.head_dim)

    def _values(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Gathered K/V in `dtype`: 16-bit pages as they are, FP8 pages as value * 2^-120 (see `_factors`)."""
        return fp8_bits_to(stored, dtype) if self.is_fp8 else cast(stored, dtype)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q `[T, Hq, D]`, k/v `[T, Hkv, D]` -> `[T, Hq, D]` in q.dtype."""
        if self.is_triton:
            store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping, self.k_scale, self.v_scale)
        else:
            self._store_torch(k, v, batch.slot_mapping)
        if batch.is_prefill:
            return self._prefill(q, batch)
        if self.is_triton:
            return paged_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                batch.block_tables,
                batch.context_lens,
                self.k_scale,
                self.v_scale,
                self.sm_scale,
                max_seq_len=batch.max_context_len,
            )
        return self._decode_torch(q, batch)

    def _decode_torch(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every sequence at once. Slots past a sequence's length read the zero page, so whatever other
        slots hold (another request's K/V, NaN from a failed one) cannot turn a zero weight into NaN."""
        assert batch.attn_bias is not None, "decode batches carry their length mask"
        num_seqs, num_slots = batch.context_slots.shape
        # CPU matmuls: fp32 is fastest for small problems and falls off a cliff above ~1K keys x queries,
        # where bf16 (AVX-512 BF16 here) is steady
        is_small = num_seqs * num_slots <= _SMALL_ATTENTION
        dtype = torch.float32 if is_small or q.dtype == torch.float32 else q.dtype
        group, rows = self.num_heads // self.num_kv_heads, num_seqs * self.num_kv_heads
        kv = self._gather(batch.context_slots)  # [2, B, C, Hkv, D]
        k_t = self._values(kv[0].permute(0, 2, 3, 1).reshape(rows, self.head_dim, num_slots), dtype)
        v = self._values(kv[1].permute(0, 2, 1, 3).reshape(rows, num_slots, self.head_dim), dtype)
        q_grouped = q.view(num_seqs, self.num_kv_heads, group, self.head_dim)  # head h reads KV head h // G
        if self.is_fp8:
            q_grouped = q_grouped.float() * self._factors[0]
        q_grouped = cast(q_grouped, dtype).reshape(rows, group, self.head_dim)
        scores = torch.baddbmm(cast(batch.attn_bias, dtype), q_grouped, k_t, alpha=self.sm_scale)
        probs = cast(torch.softmax(scores, dim=-1, dtype=torch.float32), dtype)  # [B*Hkv, G, C]
        out = torch.bmm(probs, v).view(num_seqs, self.num_kv_heads, group, self.head_dim)
        if self.is_fp8:
            out = out.float() * self._factors[1]
        return cast(out, q.dtype).view(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its whole context (cached pages included)."""
        out = torch.empty_like(q)
        start = 0
        for b, (query_len, context_len) in enumerate(
            zip(batch.query_lens, batch.context_lens_list, strict=True)
        ):
            kv = self._values(self._gather(batch.context_slots[b, :context_len]), torch.float32)
            if self.is_fp8:  # [2, C, Hkv, D] * [2, 1, Hkv, 1]: exactly fp8 * scale
                kv = kv * self._factors[:, None, :, :, 0]
            k, v = kv[:, None]  # [1, C, Hkv, D] each
            rows = torch.arange(query_len, device=q.device)[:, None] + (context_len - query_len)
            mask = torch.arange(context_len, device=q.device)[None, :] <= rows  # [L, C]
            o = F.scaled_dot_product_attention(
                q[start : start + query_len].float().transpose(0, 1)[None],
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                scale=self.sm_scale,
                enable_gqa=True,
            )  # [1, Hq, L, D]
            out[start : start + query_len] = o[0].transpose(0, 1)
            start += query_len
        return out
