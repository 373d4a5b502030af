"""Triton kernels of the KV pool's integrity checks: the batched tag compare and the sampled-bytes hash.

Spec: `integrity_check.check_page_tags_reference` and `sampled_page_hash_reference`. Both are gathers
with integer arithmetic (exact; the interpreter agrees bit for bit). Imports Triton; loaded lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.integrity_check import check_hash_inputs, check_tag_inputs
from kvq.runtime.kernels.triton_launch import kernel_for, next_pow2

TAG_BLOCK = 256


@triton.jit
def check_page_tags_kernel(
    page_tags_ptr,
    page_ids_ptr,
    expected_ptr,
    out_ptr,
    num_entries,
    num_pages,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_entries
    page_ids = tl.load(page_ids_ptr + offs, mask=mask, other=0).to(tl.int64)
    expected = tl.load(expected_ptr + offs, mask=mask, other=0)
    is_checked = expected != 0
    is_in_range = (page_ids >= 0) & (page_ids < num_pages)
    found = tl.load(page_tags_ptr + page_ids, mask=mask & is_checked & is_in_range, other=0)
    is_bad = is_checked & tl.where(is_in_range, found != expected, True)
    tl.store(out_ptr + offs, is_bad.to(tl.int8), mask=mask)


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


def check_page_tags_triton(
    page_tags: torch.Tensor, page_ids: torch.Tensor, expected: torch.Tensor
) -> torch.Tensor:
    """Triton path of `check_page_tags`: [N] bool, one program per TAG_BLOCK entries."""
    check_tag_inputs(page_tags, page_ids, expected)
    num_entries = page_ids.shape[0]
    out = torch.empty(num_entries, dtype=torch.int8, device=page_ids.device)
    if num_entries == 0:
        return out.view(torch.bool)
    if page_tags.stride(0) != 1 or page_ids.stride(0) != 1 or expected.stride(0) != 1:
        raise ValueError("page_tags, page_ids and expected must be contiguous")
    kernel = kernel_for(check_page_tags_kernel, page_ids.device)
    kernel[(triton.cdiv(num_entries, TAG_BLOCK),)](
        page_tags, page_ids, expected, out, num_entries, page_tags.shape[0], BLOCK=TAG_BLOCK
    )
    return out.view(torch.bool)


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
