"""The checked KV pool's per-step proof (see `kvq.runtime.integrity`): one batched gather-and-compare over
the very tensors the step's kernels will read, and the write guard every forward applies.

Reference (the spec, also the torch path) and the device dispatch; the Triton kernel is in
`triton/step_check.py`. Imports torch and kvq.runtime.kernels.backend only.

`check_step(page_tags [P] int64, block_tables [B, M] int, context_lens [B] int, positions [T] int64,
slot_mapping [T] int64, expected_tags [B, M] int64, expected_lens [B] int64, token_rows [T] int64,
expected_positions [T] int64, page_size) -> (is_bad [B * M + B + T] bool, write_tags [T] int64)`.
The `expected_*` and `token_rows` come from the requests' own state, never from the batch:
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

import torch

from kvq.runtime.kernels.backend import resolve_backend


def check_step_inputs(
    page_tags: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    expected_tags: torch.Tensor,
    expected_lens: torch.Tensor,
    token_rows: torch.Tensor,
    expected_positions: torch.Tensor,
) -> None:
    """Shapes, dtypes and devices of `check_step` (ValueError / TypeError naming what is wrong)."""
    if block_tables.dim() != 2 or page_tags.dim() != 1:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and page_tags {tuple(page_tags.shape)} must be "
            "[B, M] and [P]"
        )
    num_rows, num_tokens = block_tables.shape[0], positions.shape[0] if positions.dim() == 1 else -1
    shapes = {
        "expected_tags": (expected_tags, tuple(block_tables.shape)),
        "context_lens": (context_lens, (num_rows,)),
        "expected_lens": (expected_lens, (num_rows,)),
        "slot_mapping": (slot_mapping, (num_tokens,)),
        "token_rows": (token_rows, (num_tokens,)),
        "expected_positions": (expected_positions, (num_tokens,)),
    }
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    int64 = (page_tags, positions, slot_mapping, expected_tags, expected_lens, token_rows, expected_positions)
    if any(t.dtype != torch.int64 for t in int64) or block_tables.is_floating_point():
        raise TypeError(
            "page_tags, positions, slot_mapping and the expectations must be int64 and block_tables, "
            f"context_lens integer; got {[t.dtype for t in int64]}, {block_tables.dtype}"
        )
    if context_lens.is_floating_point():
        raise TypeError(f"context_lens must be integer, got {context_lens.dtype}")
    if len({t.device for t in (*int64, block_tables, context_lens)}) != 1:
        raise ValueError("page_tags, the batch tensors and the expectations must share a device")


def check_step_reference(
    page_tags: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    expected_tags: torch.Tensor,
    expected_lens: torch.Tensor,
    token_rows: torch.Tensor,
    expected_positions: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_bad [B * M + B + T] bool, write_tags [T] int64): see the module docstring."""
    check_step_inputs(
        page_tags, block_tables, context_lens, positions, slot_mapping,
        expected_tags, expected_lens, token_rows, expected_positions,
    )  # fmt: skip
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
    page_tags: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    expected_tags: torch.Tensor,
    expected_lens: torch.Tensor,
    token_rows: torch.Tensor,
    expected_positions: torch.Tensor,
    page_size: int,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`check_step_reference` on the backend chosen for the tensors' device (Triton on CUDA)."""
    args = (
        page_tags, block_tables, context_lens, positions, slot_mapping,
        expected_tags, expected_lens, token_rows, expected_positions, page_size,
    )  # fmt: skip
    if resolve_backend(page_tags.device, backend) == "torch":
        return check_step_reference(*args)
    from kvq.runtime.kernels.triton.step_check import check_step_triton

    return check_step_triton(*args)


def guard_slot_mapping(
    page_tags: torch.Tensor, slot_mapping: torch.Tensor, write_tags: torch.Tensor, page_size: int
) -> torch.Tensor:
    """[T] int64: `slot_mapping`, -1 where the page no longer carries the tag the write was checked
    against (a few elementwise ops, in stream order before the forward's first store)."""
    pages = slot_mapping.div(page_size, rounding_mode="floor").clamp(0, page_tags.shape[0] - 1)
    return torch.where(page_tags[pages] == write_tags, slot_mapping, -1)
