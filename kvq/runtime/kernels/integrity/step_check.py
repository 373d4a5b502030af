"""The checked KV pool's per-step proof (see `kvq.runtime.integrity`): one batched gather-and-compare over
the very tensors the step's kernels will read, and the write guard every forward applies.

Reference (the spec, also the torch path) and the device dispatch; the Triton kernel is in
`triton/step_check.py`. Imports torch, kvq.runtime.kernels.backend and `tensor_checks` only.

`check_step(StepCheckInputs, page_size) -> (is_bad [B * M + B + T] bool, write_tags [T] int64)`, the
inputs being the batch's tensors and the expectations (`StepCheckInputs`, shapes there). The
`expected_*` and `token_rows` come from the requests' own state, never from the batch:
- entry (b, j): `expected_tags[b, j] != 0` and the page id is outside [0, P) or `page_tags[id] !=
  expected_tags[b, j]`; or `expected_tags[b, j] == 0` (the request holds no page there) and the entry
  is not the padding -1.
- row b: `context_lens[b] != expected_lens[b]`.
- token t of row r = token_rows[t] at p = expected_positions[t]: `positions[t] != p`, or `slot_mapping[t]
  != block_tables[r, p // page_size] * page_size + p % page_size` (or that entry is missing).
With every entry and row good, a token's K/V goes to the slot its position owns, in a page that carries
its request's tag, and attention reads exactly the request's own slots. `write_tags[t] =
expected_tags[r, p // page_size]`: the tag the page must still carry when the write lands (0 when the
index is out of range), for `guard_slot_mapping`.

`guard_slot_mapping(page_tags, slot_mapping, write_tags, page_size) -> [T] int64`: the slot mapping with
-1 (the store's "skip") where `page_tags[slot // page_size] != write_tags`: a write whose page moved on
after the batch was checked (its request stopped, the page taken by another) never lands.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.integrity.tensor_checks import check_tensors


class StepCheckInputs(NamedTuple):
    """What `check_step` compares: the pool's page tags, the batch's tensors, the requests' expectations
    (in this order: the Triton kernel takes them as its first pointers)."""

    page_tags: torch.Tensor  # [P] int64
    block_tables: torch.Tensor  # [B, M] int
    context_lens: torch.Tensor  # [B] int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    expected_tags: torch.Tensor  # [B, M] int64
    expected_lens: torch.Tensor  # [B] int64
    token_rows: torch.Tensor  # [T] int64
    expected_positions: torch.Tensor  # [T] int64


def check_step_inputs(inputs: StepCheckInputs) -> None:
    """Shapes, dtypes and devices of `check_step` (ValueError / TypeError naming what is wrong)."""
    page_tags, block_tables, positions = inputs.page_tags, inputs.block_tables, inputs.positions
    if block_tables.dim() != 2 or page_tags.dim() != 1 or positions.dim() != 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, page_tags {tuple(page_tags.shape)} and positions "
            f"{tuple(positions.shape)} must be [B, M], [P] and [T]"
        )
    rows, tokens = (block_tables.shape[0],), tuple(positions.shape)
    shapes = {"expected_tags": tuple(block_tables.shape), "context_lens": rows, "expected_lens": rows}
    shapes |= {"slot_mapping": tokens, "token_rows": tokens, "expected_positions": tokens}
    check_tensors(inputs._asdict(), shapes, integer=("block_tables", "context_lens"))


def check_step_reference(inputs: StepCheckInputs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_bad [B * M + B + T] bool, write_tags [T] int64): see the module docstring."""
    check_step_inputs(inputs)
    page_tags, block_tables, context_lens, positions, slot_mapping = inputs[:5]
    expected_tags, expected_lens, token_rows, expected_positions = inputs[5:]
    num_rows, width = block_tables.shape
    pages = block_tables.flatten().long()  # [B * M]
    tags = expected_tags.flatten()
    in_pool = pages.clamp(0, page_tags.shape[0] - 1)  # equal to `pages` where the id is a page
    bad_entries = torch.where(tags == 0, pages != -1, (in_pool != pages) | (page_tags[in_pool] != tags))
    bad_lens = context_lens != expected_lens
    index = expected_positions.div(page_size, rounding_mode="floor")
    in_table, row = index.clamp(0, max(width - 1, 0)), token_rows.clamp(0, max(num_rows - 1, 0))
    is_index = (in_table == index) & (row == token_rows)  # the token's own entry exists
    flat = row * width + in_table  # [T]: the entry each token writes through (clamped into the table)
    page = pages[flat] if pages.numel() else torch.full_like(flat, -1)
    own_slot = page * page_size + expected_positions.remainder(page_size)
    bad_tokens = ~is_index | (page < 0) | (positions != expected_positions) | (slot_mapping != own_slot)
    write_tags = torch.where(is_index, tags[flat], 0) if tags.numel() else torch.zeros_like(flat)
    return torch.cat([bad_entries, bad_lens, bad_tokens]), write_tags


def check_step(
    inputs: StepCheckInputs, page_size: int, *, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`check_step_reference` on the backend chosen for the tensors' device (Triton on CUDA)."""
    if resolve_backend(inputs.page_tags.device, backend) == "torch":
        return check_step_reference(inputs, page_size)
    from kvq.runtime.kernels.triton.step_check import check_step_triton

    return check_step_triton(inputs, page_size)


def guard_slot_mapping(
    page_tags: torch.Tensor, slot_mapping: torch.Tensor, write_tags: torch.Tensor, page_size: int
) -> torch.Tensor:
    """[T] int64: `slot_mapping`, -1 where the page no longer carries the tag the write was checked
    against (a few elementwise ops, in stream order before the forward's first store)."""
    pages = slot_mapping.div(page_size, rounding_mode="floor").clamp(0, page_tags.shape[0] - 1)
    return torch.where(page_tags[pages] == write_tags, slot_mapping, -1)
