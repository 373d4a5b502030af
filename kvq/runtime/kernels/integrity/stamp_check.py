"""The checked KV pool's slot stamps (see `kvq.runtime.integrity`): written by every KV store with each
token's K/V, and verified for every slot a step reads before the forward.

Reference (the spec, also the torch path on every device) and the dispatch to the C op on CPU
(`cpu/_ops_stamps.h`). Imports torch, `cpu_calls` and `tensor_checks` only.

The pool keeps `stamps` int64 `[P + 1, page_size, L]`: each layer's stamp of each slot, side by side, so
a slot's stamps are one contiguous read. A layer's store sees its column as `[num_slots]` (stride L).
A slot's stamp is `writer ^ position`: the writer tag of the page it was written into (the fill tag the
page was taken with: owner request, logical index, allocation generation, `integrity.tags`) and the
token's position. The writer's identity is in the high 32 bits (positions stay below 2^32), so a stamp
that is not the reader's names who wrote it.

- `write_stamps(stamps [S] int64, slot_mapping [T] int, slot_stamps [T] int64)`: `stamps[slot] =
  slot_stamps[t]` for every slot >= 0 (what each store does in its own pass).
- `check_stamps(stamps [P1, page_size, L] int64, block_tables [B, M] int, expected_writers [B, M] int64,
  read_lens [B] int64) -> [B] int64`: for row b, the first position p < read_lens[b] whose slot
  (`block_tables[b, p // page_size]`, offset `p % page_size`) carries, in any layer, a stamp other than
  `expected_writers[b, p // page_size] ^ p`, or whose page is outside the pool; `M * page_size` when
  read_lens[b] runs past the table and every slot before is good; -1 when all are good. A logical page
  whose expected writer is 0 is not checked (a page this very step writes).
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.integrity.cpu_calls import check_stamps_native, stamps_check_applies
from kvq.runtime.kernels.integrity.tensor_checks import check_tensors


def stamp_of(writer_tags: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T] int64: the stamps `writer_tags ^ positions` (elementwise)."""
    return writer_tags ^ positions


def write_stamps(stamps: torch.Tensor, slot_mapping: torch.Tensor, slot_stamps: torch.Tensor) -> None:
    """In place, `stamps[slot_mapping[t]] = slot_stamps[t]` for slots >= 0; no host sync (a skipped
    token's stamp goes to the last slot, of the pool's zero page, which no check reads)."""
    slots = slot_mapping.long()
    stamps.index_copy_(0, torch.where(slots >= 0, slots, stamps.shape[0] - 1), slot_stamps)


def check_stamps_inputs(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> None:
    """Shapes, dtypes and devices of `check_stamps` (ValueError / TypeError naming what is wrong)."""
    if stamps.dim() != 3 or block_tables.dim() != 2:
        raise ValueError(
            f"stamps {tuple(stamps.shape)} and block_tables {tuple(block_tables.shape)} must be "
            "[P1, page_size, L] and [B, M]"
        )
    tensors = {
        "stamps": stamps, "block_tables": block_tables, "expected_writers": expected_writers,
        "read_lens": read_lens,
    }  # fmt: skip
    shapes = {"expected_writers": tuple(block_tables.shape), "read_lens": (block_tables.shape[0],)}
    check_tensors(tensors, shapes, integer=("block_tables",))


def check_stamps_reference(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> torch.Tensor:
    """[B] int64: each row's first bad position, or -1 (see the module docstring)."""
    check_stamps_inputs(stamps, block_tables, expected_writers, read_lens)
    num_slot_pages, page_size = stamps.shape[:2]
    width = block_tables.shape[1]
    end = width * page_size
    positions = torch.arange(end, device=stamps.device)  # [N]
    index = positions // page_size
    pages = block_tables.long()[:, index]  # [B, N]
    writers = expected_writers[:, index]  # [B, N]
    is_read = (positions[None] < read_lens[:, None]) & (writers != 0)
    in_pool = pages.clamp(0, num_slot_pages - 1)
    found = stamps[in_pool, positions % page_size]  # [B, N, L]
    is_wrong = (found != stamp_of(writers, positions)[..., None]).any(-1) | (in_pool != pages)
    first = torch.where(is_read & is_wrong, positions, end).min(dim=1).values if end else read_lens * 0 + end
    return torch.where(first < end, first, torch.where(read_lens > end, end, -1))


def check_stamps(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> torch.Tensor:
    """`check_stamps_reference`, by the C op on CPU where it applies (the same values)."""
    if stamps_check_applies(stamps, block_tables, expected_writers, read_lens):
        return check_stamps_native(stamps, block_tables, expected_writers, read_lens)
    return check_stamps_reference(stamps, block_tables, expected_writers, read_lens)
