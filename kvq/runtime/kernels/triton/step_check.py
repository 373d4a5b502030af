"""Triton kernel of the checked KV pool's per-step proof: every block-table entry, context length and new
token of a step checked in one launch.

Spec: `integrity.step_check.check_step_reference` (integer gathers and compares: the interpreter agrees bit
for bit). One flat index space of B * M table entries, then B rows, then T tokens; each lane checks its own.
Imports Triton; loaded lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvq.runtime.kernels.integrity.step_check import StepCheckInputs, check_step_inputs
from kvq.runtime.kernels.triton.launch import kernel_for

STEP_BLOCK = 256


@triton.jit
def check_step_kernel(
    page_tags_ptr,
    block_tables_ptr,
    context_lens_ptr,
    positions_ptr,
    slot_mapping_ptr,
    expected_tags_ptr,
    expected_lens_ptr,
    token_rows_ptr,
    expected_positions_ptr,
    is_bad_ptr,
    write_tags_ptr,
    num_pages,
    num_rows,
    width,
    num_tokens,
    page_size,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    num_entries = num_rows * width
    is_entry = offs < num_entries
    is_row = (offs >= num_entries) & (offs < num_entries + num_rows)
    is_token = (offs >= num_entries + num_rows) & (offs < num_entries + num_rows + num_tokens)

    # table entries: the page carries the request's tag, or the request holds none and the entry is -1
    pages = tl.load(block_tables_ptr + offs, mask=is_entry, other=-1).to(tl.int64)
    tags = tl.load(expected_tags_ptr + offs, mask=is_entry, other=0)
    is_in_range = (pages >= 0) & (pages < num_pages)
    found = tl.load(page_tags_ptr + pages, mask=is_entry & is_in_range, other=0)
    bad_entry = tl.where(tags == 0, pages != -1, (~is_in_range) | (found != tags))

    # rows: the context length the kernels read is the tokens the request holds
    row = offs - num_entries
    context_len = tl.load(context_lens_ptr + row, mask=is_row, other=0).to(tl.int64)
    bad_row = context_len != tl.load(expected_lens_ptr + row, mask=is_row, other=0)

    # tokens: the position is the request's, the slot is the one that position owns
    t = offs - num_entries - num_rows
    token_row = tl.load(token_rows_ptr + t, mask=is_token, other=0)
    position = tl.load(expected_positions_ptr + t, mask=is_token, other=0)
    index = position // page_size
    is_index = is_token & (position >= 0) & (index < width) & (token_row >= 0) & (token_row < num_rows)
    flat = token_row * width + index
    page = tl.load(block_tables_ptr + flat, mask=is_index, other=-1).to(tl.int64)
    own_slot = page * page_size + position % page_size
    found_position = tl.load(positions_ptr + t, mask=is_token, other=0)
    slot = tl.load(slot_mapping_ptr + t, mask=is_token, other=0)
    bad_token = (found_position != position) | (page < 0) | (slot != own_slot)
    write_tag = tl.load(expected_tags_ptr + flat, mask=is_index, other=0)

    is_bad = tl.where(is_entry, bad_entry, tl.where(is_row, bad_row, bad_token))
    tl.store(is_bad_ptr + offs, is_bad.to(tl.int8), mask=offs < num_entries + num_rows + num_tokens)
    tl.store(write_tags_ptr + t, write_tag, mask=is_token)


def check_step_triton(inputs: StepCheckInputs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton path of `check_step`: one program per STEP_BLOCK entries of the flat index space."""
    check_step_inputs(inputs)
    if not all(t.is_contiguous() for t in inputs):
        raise ValueError("page_tags, the batch tensors and the expectations must be contiguous")
    num_rows, width = inputs.block_tables.shape
    num_tokens = inputs.positions.shape[0]
    total = num_rows * width + num_rows + num_tokens
    device = inputs.page_tags.device
    is_bad = torch.empty(total, dtype=torch.int8, device=device)
    write_tags = torch.empty(num_tokens, dtype=torch.int64, device=device)
    if total == 0:
        return is_bad.view(torch.bool), write_tags
    kernel = kernel_for(check_step_kernel, device)
    kernel[(triton.cdiv(total, STEP_BLOCK),)](
        *inputs, is_bad, write_tags,
        inputs.page_tags.shape[0], num_rows, width, num_tokens, page_size,
        BLOCK=STEP_BLOCK,
    )  # fmt: skip
    return is_bad.view(torch.bool), write_tags
