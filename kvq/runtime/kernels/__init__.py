"""Device-dispatching kernels of the kvq runtime: Triton on CUDA, torch on CPU (override: KVQ_KERNELS).

The only package of kvq that imports Triton, and only lazily (inside the calls that run a Triton
kernel), so `import kvq.runtime.kernels` works without Triton. Contracts: W4A16 layout in `w4a16`,
paged KV cache in `kv_cache_layout`; the backend choice in `backend`.

Public API
- `prepare_w4a16(weight_packed, weight_scale, group_size, backend=None) -> W4A16Weight`: once at load,
  on the device where it will run; `[N, K/8]` int32 + `[N, K/G]` bf16, or `[E, N, K/8]` + `[E, N, K/G]`
  for stacked experts. Triton keeps the tensors as loaded; the CPU torch path repacks for
  `aten._weight_int4pack_mm_for_cpu` (no dense copy is kept by either).
- `w4a16_linear(x [..., K], w) -> [..., N]` in x.dtype (CPU fast path: bf16 activations);
  `w4a16_linear_of(w)`: the same for x `[M, K]`, bound once (at load) to the kernel `w` was prepared for.
- `fused_moe_w4a16(x [T, H], topk_ids [T, k], topk_weights [T, k], w13 [E, 2I, H], w2 [E, H, I]) -> [T, H]`:
  y = sum_j topk_weights[:, j] * down(SiLU(gate) * up) of expert topk_ids[:, j]; w13 rows = gate then up.
  `fused_moe_of(w13, w2)`: the same, bound once to the backend both were prepared for.
- `PagedKVCache.of(k_cache, v_cache, k_scale, v_scale, backend=None)`: one layer's pages and scales,
  checked once and bound to a backend (the engine makes one per attention layer at bind), with
  `.store(k [T, Hkv, D], v, slot_mapping, slot_stamps=None)` (in place),
  `.decode_attention(q [B, Hq, D], tables, sm_scale=None) -> [B, Hq, D]` and
  `.prefill_attention(q [T, Hq, D], block_tables, query_lens, seq_lens, sm_scale) -> [T, Hq, D]` (causal
  over each sequence's pages; torch SDPA on every backend). `tables` (`DecodeTables`: block_tables,
  seq_lens, max_seq_len, the torch path's `plan` from `plan_paged_decode`, MLA's token_indices) is made
  once per step and read by every layer. The references (`*_reference`) take the same objects.
Prepared weights and KV caches carry the backend they were made for: `backend=`, else $KVQ_KERNELS
(auto|torch|triton), else the device.
On CPU, the engine chooses its kernels once, at load: `CpuOps.choose(EngineConfig.cpu_isa)` (else
$KVQ_CPU_ISA: auto|amx|avx512bf16|avx512|avx2|scalar|torch; `describe_cpu_path` says which runs, for logs
and benchmarks); W4A16 weights and KV caches carry that choice, and the layers call its methods.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from kvq.runtime.kernels.backend import KVQ_KERNELS_ENV, resolve_backend
from kvq.runtime.kernels.cpu.isa import CPU_ISA_ENV, resolve_cpu_isa
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.cpu.path import describe_cpu_path
from kvq.runtime.kernels.fused_moe import fused_moe_reference, fused_moe_torch
from kvq.runtime.kernels.paged.attention import (
    DecodeTables,
    PagedDecodePlan,
    paged_decode_attention_reference,
    plan_paged_decode,
)
from kvq.runtime.kernels.paged.kv_cache import PagedKVCache
from kvq.runtime.kernels.paged.kv_store import store_kv_reference
from kvq.runtime.kernels.w4a16 import (
    W4A16Weight,
    check_w4a16_tensors,
    compressed_tensors_weight,
    prepare_w4a16_torch,
    w4a16_linear_torch,
    w4a16_reference,
)

__all__ = [
    "CPU_ISA_ENV",
    "CpuOps",
    "DecodeTables",
    "KVQ_KERNELS_ENV",
    "PagedDecodePlan",
    "PagedKVCache",
    "W4A16Weight",
    "describe_cpu_path",
    "fused_moe_of",
    "fused_moe_reference",
    "fused_moe_w4a16",
    "paged_decode_attention_reference",
    "plan_paged_decode",
    "prepare_w4a16",
    "resolve_backend",
    "resolve_cpu_isa",
    "store_kv_reference",
    "w4a16_linear",
    "w4a16_linear_of",
    "w4a16_reference",
]


def prepare_w4a16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    *,
    backend: str | None = None,
    int8_activations: bool = False,
    cpu_ops: CpuOps | None = None,
) -> W4A16Weight:
    """Check a pack-quantized weight and ready it for the backend chosen for its device (once, at load);
    on CPU for the engine's kernels (`cpu_ops`; None: `CpuOps.choose()`), with int8_activations for the
    W4A8 kernel (`cpu.w4a8`, where it runs; stacked experts too)."""
    check_w4a16_tensors(weight_packed, weight_scale, group_size)
    if resolve_backend(weight_packed.device, backend) == "torch":
        return prepare_w4a16_torch(weight_packed, weight_scale, group_size, int8_activations, cpu_ops)
    return compressed_tensors_weight("triton", weight_packed, weight_scale, group_size)


def w4a16_linear(x: torch.Tensor, w: W4A16Weight) -> torch.Tensor:
    """y = x @ W^T for x `[..., K]` -> `[..., N]` in x.dtype, on the backend `w` was prepared for."""
    if w.num_experts is not None:
        raise ValueError(f"w holds {w.num_experts} stacked experts: use fused_moe_w4a16")
    if w.native is not None and x.dim() == 2 and x.shape[1] == w.in_features:
        return w.native(x)  # the CPU kernel's short path (decode calls it ~100 times per token)
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected [..., {w.in_features}]")
    x2d = x.reshape(-1, w.in_features)
    if w.backend == "torch":
        y = w4a16_linear_torch(x2d, w)
    else:
        from kvq.runtime.kernels.triton.w4a16 import w4a16_linear_triton

        y = w4a16_linear_triton(x2d, w)
    return y.reshape(*x.shape[:-1], w.out_features)


def w4a16_linear_of(w: W4A16Weight) -> Callable[[torch.Tensor], torch.Tensor]:
    """`w4a16_linear(x, w)` for x `[M, K]`, bound once (at load) to the kernel `w` was prepared for: the
    CPU kernel's call, the torch path or the Triton launcher (imported here, not at import)."""
    if w.num_experts is not None:
        raise ValueError(f"w holds {w.num_experts} stacked experts: use fused_moe_of")
    if w.native is not None:
        return w.native
    if w.backend == "torch":
        return partial(w4a16_linear_torch, w=w)
    from kvq.runtime.kernels.triton.w4a16 import w4a16_linear_triton

    return partial(w4a16_linear_triton, w=w)


def fused_moe_of(w13: W4A16Weight, w2: W4A16Weight) -> Callable[..., torch.Tensor]:
    """`fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)` with the experts bound, on the backend both
    were prepared for (chosen once, at load)."""
    if w13.backend != w2.backend:
        raise ValueError(f"w13 was prepared for {w13.backend} but w2 for {w2.backend}: prepare both alike")
    if w13.backend == "torch":
        return partial(fused_moe_torch, w13=w13, w2=w2)
    from kvq.runtime.kernels.triton.fused_moe import fused_moe_triton

    return partial(fused_moe_triton, w13=w13, w2=w2)


def fused_moe_w4a16(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: W4A16Weight, w2: W4A16Weight
) -> torch.Tensor:
    """Routed experts' SiLU-gated MLP, weighted by topk_weights and summed: `[T, H]` in x.dtype."""
    return fused_moe_of(w13, w2)(x, topk_ids, topk_weights)
