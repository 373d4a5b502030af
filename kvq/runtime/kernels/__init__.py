"""Device-dispatching kernels of the kvq runtime: Triton on CUDA, torch on CPU (override: KVQ_KERNELS).

The only package of kvq that imports Triton, and only lazily (inside the calls that run a Triton
kernel), so `import kvq.runtime.kernels` works without Triton. Contracts: W4A16 layout in `w4a16`,
paged KV cache in `kv_cache_layout`; the backend choice in `backend`.

Public API
- `prepare_w4a16(weight_packed, weight_scale, group_size, backend=None) -> W4A16Weight`: once at load,
  on the device where it will run; `[N, K/8]` int32 + `[N, K/G]` bf16, or `[E, N, K/8]` + `[E, N, K/G]`
  for stacked experts. Triton keeps the tensors as loaded; the CPU torch path repacks for
  `aten._weight_int4pack_mm_for_cpu` (no dense copy is kept by either).
- `w4a16_linear(x [..., K], w) -> [..., N]` in x.dtype (CPU fast path: bf16 activations).
- `fused_moe_w4a16(x [T, H], topk_ids [T, k], topk_weights [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T, H]`:
  y = sum_j topk_weights[:, j] * down(SiLU(gate) * up) of expert topk_ids[:, j]; w13 rows = gate then up.
- `paged_decode_attention(q [B, Hq, D], k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale,
  sm_scale, max_seq_len=None) -> [B, Hq, D]` in q.dtype.
- `store_kv(k [T, Hkv, D], v, k_cache, v_cache, slot_mapping, k_scale, v_scale)`: in place.
Weights carry the backend they were prepared for; the other calls resolve it per call from the
tensors' device, `backend=` or $KVQ_KERNELS (auto|torch|triton).
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.backend import KVQ_KERNELS_ENV, resolve_backend
from kvq.runtime.kernels.fused_moe import fused_moe_reference, fused_moe_torch
from kvq.runtime.kernels.kv_store import store_kv_reference
from kvq.runtime.kernels.paged_attention import paged_decode_attention_reference
from kvq.runtime.kernels.w4a16 import (
    W4A16Weight,
    check_w4a16_tensors,
    compressed_tensors_weight,
    dequantize_w4a16,
    prepare_w4a16_torch,
    w4a16_linear_torch,
    w4a16_reference,
)

__all__ = [
    "KVQ_KERNELS_ENV",
    "W4A16Weight",
    "dequantize_w4a16",
    "fused_moe_reference",
    "fused_moe_w4a16",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "prepare_w4a16",
    "resolve_backend",
    "store_kv",
    "store_kv_reference",
    "w4a16_linear",
    "w4a16_reference",
]


def prepare_w4a16(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, *, backend: str | None = None
) -> W4A16Weight:
    """Check a pack-quantized weight and ready it for the backend chosen for its device (once, at load)."""
    check_w4a16_tensors(weight_packed, weight_scale, group_size)
    if resolve_backend(weight_packed.device, backend) == "torch":
        return prepare_w4a16_torch(weight_packed, weight_scale, group_size)
    return compressed_tensors_weight("triton", weight_packed, weight_scale, group_size)


def w4a16_linear(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """y = x @ W^T for x `[..., K]` -> `[..., N]` in x.dtype, on the backend `w` was prepared for."""
    if w.num_experts is not None:
        raise ValueError(f"w holds {w.num_experts} stacked experts: use fused_moe_w4a16")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [..., {w.in_features}]")
    x2d = x.reshape(-1, w.in_features)
    if w.backend == "torch":
        y = w4a16_linear_torch(x2d, w)
    else:
        from kvq.runtime.kernels.w4a16_triton import w4a16_linear_triton

        y = w4a16_linear_triton(x2d, w)
    return y.reshape(*x.shape[:-1], w.out_features)


def fused_moe_w4a16(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: W4A16Weight, w2: W4A16Weight
) -> torch.Tensor:
    """Routed experts' SiLU-gated MLP, weighted by topk_weights and summed: `[T, H]` in x.dtype."""
    if w13.backend != w2.backend:
        raise ValueError(f"w13 was prepared for {w13.backend} but w2 for {w2.backend}: prepare both alike")
    if w13.backend == "torch":
        return fused_moe_torch(x, topk_ids, topk_weights, w13, w2)
    from kvq.runtime.kernels.fused_moe_triton import fused_moe_triton

    return fused_moe_triton(x, topk_ids, topk_weights, w13, w2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    sm_scale: float | None = None,
    *,
    max_seq_len: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention of q `[B, Hq, D]` over paged K/V (see `kv_cache_layout`): `[B, Hq, D]` in q.dtype.

    `max_seq_len` (an upper bound of seq_lens, known to the scheduler) spares the Triton path a sync.
    """
    if resolve_backend(q.device, backend) == "torch":
        return paged_decode_attention_reference(
            q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale
        )
    from kvq.runtime.kernels.paged_attention_triton import paged_decode_attention_triton

    return paged_decode_attention_triton(
        q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, max_seq_len=max_seq_len
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    backend: str | None = None,
) -> None:
    """Write k, v `[T, Hkv, D]` into slots `slot_mapping` `[T]` (negative: skip); FP8 pages quantize."""
    if resolve_backend(k.device, backend) == "torch":
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    from kvq.runtime.kernels.kv_store_triton import store_kv_triton

    store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
