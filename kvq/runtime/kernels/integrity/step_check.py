"""The checked KV pool's per-step proof (see `kvq.runtime.integrity`): one batched gather-and-compare over
the very tensors the step's kernels will read, and the write guard every forward applies.

Reference (the spec, also the torch path) and the device dispatch; the C calls on CPU are in
`cpu_calls.py`, the Triton kernel in `triton/step_check.py`. Imports torch,
kvq.runtime.kernels.backend, `tensor_checks` and `cpu_calls` only.

`check_step(StepCheckInputs, page_size, writers [B, M] int64 | None) -> (is_bad [B * M + B + T] bool,
write_tags [T] int64, slot_stamps [T] int64 | None)`, the inputs being the batch's tensors and the
expectations (`StepCheckInputs`, shapes there), `writers` each logical page's writer tag (`stamp_check`). The
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
index is out of range), for `guard_slot_mapping`. With `writers`, `slot_stamps[t] = writers[r, p // page_size]
^ p` (the entry clamped into the table): the stamp the token's store writes.

`guard_slot_mapping(page_tags, slot_mapping, write_tags, page_size) -> [T] int64`: the slot mapping with
-1 (the store's "skip") where `page_tags[slot // page_size] != write_tags`: a write whose page moved on
after the batch was checked (its request stopped, the page taken by another) never lands.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.integrity.cpu_calls import (
    check_step_native,
    guard_applies,
    guard_native,
    step_check_applies,
)
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


def check_step_inputs(inputs: StepCheckInputs, writers: torch.Tensor | None = None) -> None:
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
    tensors = inputs._asdict()
    if writers is not None:
        tensors["writers"], shapes["writers"] = writers, tuple(block_tables.shape)
    check_tensors(tensors, shapes, integer=("block_tables", "context_lens"))


def check_step_reference(
    inputs: StepCheckInputs, page_size: int, writers: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(is_bad [B * M + B + T] bool, write_tags [T] int64, slot_stamps [T] int64 or None without
    `writers`): see the module docstring."""
    check_step_inputs(inputs, writers)
    page_tags, block_tables, context_lens, positions, slot_mapping = inputs[:5]
    expected_tags, expected_lens, _, expected_positions = inputs[5:]
    pages = block_tables.flatten().long()  # [B * M]
    tags = expected_tags.flatten()
    in_pool = pages.clamp(0, page_tags.shape[0] - 1)  # equal to `pages` where the id is a page
    bad_entries = torch.where(tags == 0, pages != -1, (in_pool != pages) | (page_tags[in_pool] != tags))
    bad_lens = context_lens != expected_lens
    flat, is_index = token_entries(inputs, page_size)
    page = pages[flat] if pages.numel() else torch.full_like(flat, -1)
    own_slot = page * page_size + expected_positions.remainder(page_size)
    bad_tokens = ~is_index | (page < 0) | (positions != expected_positions) | (slot_mapping != own_slot)
    write_tags = torch.where(is_index, tags[flat], 0) if tags.numel() else torch.zeros_like(flat)
    slot_stamps = None if writers is None else slot_stamps_of(writers, inputs, flat)
    return torch.cat([bad_entries, bad_lens, bad_tokens]), write_tags, slot_stamps


def token_entries(inputs: StepCheckInputs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([T] int64, [T] bool): the flat table entry each new token writes through (its row's entry of its
    expected position's page, clamped into the table), and whether that entry exists unclamped."""
    num_rows, width = inputs.block_tables.shape
    index = inputs.expected_positions.div(page_size, rounding_mode="floor")
    in_table, row = index.clamp(0, max(width - 1, 0)), inputs.token_rows.clamp(0, max(num_rows - 1, 0))
    return row * width + in_table, (in_table == index) & (row == inputs.token_rows)


def slot_stamps_of(writers: torch.Tensor, inputs: StepCheckInputs, flat: torch.Tensor) -> torch.Tensor:
    """[T] int64: each new token's slot stamp, the writer of its table entry `flat` (`token_entries`) ^ its
    position."""
    token_writers = writers.flatten()[flat] if writers.numel() else torch.zeros_like(flat)
    return token_writers ^ inputs.expected_positions


def check_step(
    inputs: StepCheckInputs,
    page_size: int,
    writers: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`check_step_reference` on the backend chosen for the tensors' device: one C call on CPU where it
    applies, Triton on CUDA (the slot stamps then by the reference's torch ops)."""
    if resolve_backend(inputs.page_tags.device, backend) == "torch":
        if step_check_applies(inputs, writers):
            return check_step_native(inputs, page_size, writers)
        return check_step_reference(inputs, page_size, writers)
    from kvq.runtime.kernels.triton.step_check import check_step_triton

    is_bad, write_tags = check_step_triton(inputs, page_size)
    if writers is None:
        return is_bad, write_tags, None
    return is_bad, write_tags, slot_stamps_of(writers, inputs, token_entries(inputs, page_size)[0])


def guard_slot_mapping(
    page_tags: torch.Tensor, slot_mapping: torch.Tensor, write_tags: torch.Tensor, page_size: int
) -> torch.Tensor:
    """[T] int64: `slot_mapping`, -1 where the page no longer carries the tag the write was checked
    against (a few elementwise ops, in stream order before the forward's first store; one C call on CPU)."""
    if guard_applies(page_tags, slot_mapping, write_tags):
        return guard_native(page_tags, slot_mapping, write_tags, page_size)
    pages = slot_mapping.div(page_size, rounding_mode="floor").clamp(0, page_tags.shape[0] - 1)
    return torch.where(page_tags[pages] == write_tags, slot_mapping, -1)
