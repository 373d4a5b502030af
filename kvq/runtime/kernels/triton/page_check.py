"""Triton kernel of the checked KV pool's `full` mode: the sampled-bytes hash of whole pages.

Spec: `integrity.page_check.sampled_page_hash_reference`, a gather with integer arithmetic (exact; the
interpreter agrees bit for bit). Imports Triton; loaded lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.integrity.page_check import check_hash_inputs
from kvq.runtime.kernels.triton.launch import kernel_for, next_pow2


@triton.jit
def sampled_page_hash_kernel(
    pool_ptr,
    page_ids_ptr,
    offsets_ptr,
    coeffs_ptr,
    out_ptr,
    num_layers,
    stride_pl,
    stride_ph,
    stride_pp,
    stride_pr,
    stride_cl,
    stride_ch,
    stride_cs,
    NUM_PARTS: tl.constexpr,
    NUM_SAMPLES: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ids_ptr + pid).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    mask = offs_s < NUM_SAMPLES
    byte_offsets = tl.load(offsets_ptr + offs_s, mask=mask, other=0).to(tl.int64)
    byte_ptrs = pool_ptr + page * stride_pp + byte_offsets * stride_pr  # layer 0, part 0
    coeff_ptrs = coeffs_ptr + offs_s * stride_cs
    acc = tl.zeros([BLOCK_S], dtype=tl.int64)
    for _ in range(num_layers):  # pointers advance by a stride: no int32 product of layer x stride
        for part in tl.static_range(NUM_PARTS):
            sampled = tl.load(byte_ptrs + part * stride_ph, mask=mask, other=0).to(tl.int64)
            coeffs = tl.load(coeff_ptrs + part * stride_ch, mask=mask, other=0)
            acc += sampled * coeffs
        byte_ptrs += stride_pl
        coeff_ptrs += stride_cl
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def sampled_page_hash_triton(
    pool_bytes: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, coeffs: torch.Tensor
) -> torch.Tensor:
    """Triton path of `sampled_page_hash`: [N] int64, one program per page, looping over the layers."""
    check_hash_inputs(pool_bytes, page_ids, offsets, coeffs)
    num_pages = page_ids.shape[0]
    out = torch.empty(num_pages, dtype=torch.int64, device=page_ids.device)
    if num_pages == 0:
        return out
    num_samples = offsets.shape[0]
    kernel = kernel_for(sampled_page_hash_kernel, page_ids.device)
    kernel[(num_pages,)](
        pool_bytes,
        page_ids,
        offsets,
        coeffs,
        out,
        pool_bytes.shape[0],
        *pool_bytes.stride(),
        *coeffs.stride(),
        NUM_PARTS=pool_bytes.shape[1],
        NUM_SAMPLES=num_samples,
        BLOCK_S=next_pow2(num_samples),
    )
    return out
