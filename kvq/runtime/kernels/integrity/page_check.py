"""The checked KV pool's `full` mode (see `kvq.runtime.integrity`): a hash of sampled bytes of whole pages
over every layer (the per-step tag and slot proof is `integrity.step_check`).

Reference (the spec, also the torch path) and the device dispatch; the Triton kernel is in
`triton/page_check.py`, the C call on CPU in `cpu_calls.py`. Imports torch, kvq.runtime.kernels.backend and
`cpu_calls` only.

- `sampled_page_hash(pool_bytes [L, C, P1, R] uint8, page_ids [N] int, offsets [S] int64,
  coeffs [L, C, S] int64) -> [N] int64`: `sum(l, c, s) pool_bytes[l, c, page_ids[n], offsets[s]] *
  coeffs[l, c, s]` (C parts per page: GQA's K and V, MLA's one latent part). With coefficients in
  [0, 2^31) and L * C * S < 2^24 the sum never overflows, so a
  change of one sampled byte always changes the hash when its coefficient is odd. Offsets must lie in
  [0, R); they are fixed per pool and checked where they are made (no device sync per call here).
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.integrity.cpu_calls import page_hash_applies, sampled_page_hash_native

MAX_HASH_TERMS = 1 << 24  # L * C * S: 255 * 2^31 * 2^24 < 2^63


def check_hash_inputs(
    pool_bytes: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, coeffs: torch.Tensor
) -> None:
    """Shapes, dtypes and devices of `sampled_page_hash` (ValueError / TypeError naming what is wrong)."""
    if pool_bytes.dim() != 4 or page_ids.dim() != 1 or offsets.dim() != 1:
        raise ValueError(
            f"pool_bytes {tuple(pool_bytes.shape)}, page_ids {tuple(page_ids.shape)} and offsets "
            f"{tuple(offsets.shape)} must be [L, C, P1, R], [N] and [S]"
        )
    num_layers, num_parts = pool_bytes.shape[:2]
    expected = (num_layers, num_parts, offsets.shape[0])
    if tuple(coeffs.shape) != expected:
        raise ValueError(f"coeffs has shape {tuple(coeffs.shape)}, expected {expected}")
    if pool_bytes.dtype != torch.uint8 or offsets.dtype != torch.int64 or coeffs.dtype != torch.int64:
        raise TypeError(
            f"pool_bytes must be uint8 and offsets, coeffs int64, got {pool_bytes.dtype}, {offsets.dtype}, "
            f"{coeffs.dtype}"
        )
    if page_ids.is_floating_point():
        raise TypeError(f"page_ids must be integer, got {page_ids.dtype}")
    if coeffs.numel() >= MAX_HASH_TERMS:
        raise ValueError(f"{coeffs.numel()} hash terms could overflow int64; use fewer than {MAX_HASH_TERMS}")
    if not pool_bytes.device == page_ids.device == offsets.device == coeffs.device:
        raise ValueError("pool_bytes, page_ids, offsets and coeffs must share a device")


def sampled_page_hash_reference(
    pool_bytes: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, coeffs: torch.Tensor
) -> torch.Tensor:
    """[N] int64: each page's sampled bytes (every layer and part) weighted by `coeffs` and summed."""
    check_hash_inputs(pool_bytes, page_ids, offsets, coeffs)
    sampled = pool_bytes[:, :, page_ids.long()[:, None], offsets[None, :]]  # [L, C, N, S] uint8
    return (sampled.long() * coeffs[:, :, None, :]).sum(dim=(0, 1, 3))


def sampled_page_hash(
    pool_bytes: torch.Tensor,
    page_ids: torch.Tensor,
    offsets: torch.Tensor,
    coeffs: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """[N] int64 sampled-bytes hash of each page (see the module docstring): one C call on CPU where it
    applies, else the torch reference; Triton on CUDA."""
    if resolve_backend(pool_bytes.device, backend) == "torch":
        if page_hash_applies(pool_bytes, page_ids, offsets, coeffs) and coeffs.numel() < MAX_HASH_TERMS:
            return sampled_page_hash_native(pool_bytes, page_ids, offsets, coeffs)
        return sampled_page_hash_reference(pool_bytes, page_ids, offsets, coeffs)
    from kvq.runtime.kernels.triton.page_check import sampled_page_hash_triton

    return sampled_page_hash_triton(pool_bytes, page_ids, offsets, coeffs)
