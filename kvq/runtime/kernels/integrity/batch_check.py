"""The checked KV pool's whole per-step proof on CPU, one call that answers only whether anything failed:
the step check (`step_check`), the slot-stamp check (`stamp_check`) and, in full mode, the sealed pages'
sampled-bytes hashes against those recorded (`page_check`). A passing step, the hot path, costs one C call
and its two outputs; a failing one is then named by the separate checks, which this composes.

Reference (the spec: the three checks composed) and `BatchCheck`, the C call (`cpu/_ops_stamps.h`
`check_batch`) bound once to a pool's tensors. Imports torch, kvq.runtime.kernels.backend and the integrity
kernels' modules only.

`check_batch_reference(page_tags, BatchTensors, page_size, expected, stamps, hashes, sealed) -> (is_bad bool,
write_tags [T] int64, slot_stamps [T] int64 | None)`: `expected` int64 `[2 * B * M + 2 * B + 2 * T]`, flat as
`TagTracker._expected` lays it out (each row's tags, lengths, each new token's row and position, each row's
writer tags, each row's read length); `is_bad` when any entry, row or token fails `check_step`, any row fails
`check_stamps` (with `stamps`), or (with `hashes`) a page of `sealed` has a sampled-bytes hash other than its
recorded one (`NO_BYTE_HASH`: none recorded, nothing to compare) or is no page of the pool. `write_tags` and
`slot_stamps` are `check_step`'s (`slot_stamps` with `stamps` only).
"""

from __future__ import annotations

from array import array
from typing import NamedTuple

import torch

from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.kernels.integrity.cpu_calls import (
    batch_check_applies,
    batch_check_pool_args,
    check_batch_native,
)
from kvq.runtime.kernels.integrity.page_check import MAX_HASH_TERMS, sampled_page_hash_reference
from kvq.runtime.kernels.integrity.stamp_check import check_stamps_reference
from kvq.runtime.kernels.integrity.step_check import StepCheckInputs, check_step_reference

NO_BYTE_HASH = -1  # a page not hashed (yet): the sampled-bytes hash itself is never negative


class BatchTensors(NamedTuple):
    """The batch's tensors the check reads (`ForwardBatch`'s)."""

    block_tables: torch.Tensor  # [B, M] int
    context_lens: torch.Tensor  # [B] int
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64


class PageHashes(NamedTuple):
    """Full mode: the pool's bytes, the sample and each page's recorded hash."""

    pool_bytes: torch.Tensor  # [L, C, P + 1, R] uint8
    offsets: torch.Tensor  # [S] int64
    coeffs: torch.Tensor  # [L, C, S] int64
    byte_hashes: torch.Tensor  # [P] int64


def split_expected(expected: torch.Tensor, num_rows: int, width: int, num_tokens: int) -> list[torch.Tensor]:
    """The flat expectations as (tags [B, M], lens [B], token rows [T], positions [T], writers [B, M], read
    lens [B])."""
    sizes = [num_rows * width, num_rows, num_tokens, num_tokens, num_rows * width, num_rows]
    parts = list(expected.split(sizes))
    parts[0], parts[4] = parts[0].view(num_rows, width), parts[4].view(num_rows, width)
    return parts


def check_batch_reference(
    page_tags: torch.Tensor,
    batch: BatchTensors,
    page_size: int,
    expected: torch.Tensor,
    stamps: torch.Tensor | None = None,
    hashes: PageHashes | None = None,
    sealed: list[int] | None = None,
) -> tuple[bool, torch.Tensor, torch.Tensor | None]:
    """See the module docstring (`sealed`: the pages re-hashed with `hashes`)."""
    num_rows, width = batch.block_tables.shape
    tags, lens, rows, positions, writers, read_lens = split_expected(
        expected, num_rows, width, batch.positions.shape[0]
    )
    inputs = StepCheckInputs(page_tags, *batch, tags, lens, rows, positions)
    is_bad, write_tags, slot_stamps = check_step_reference(
        inputs, page_size, None if stamps is None else writers
    )
    failed = bool(is_bad.any())
    if stamps is not None:
        failed |= bool((check_stamps_reference(stamps, batch.block_tables, writers, read_lens) >= 0).any())
    if hashes is not None and sealed:
        pages = torch.tensor(sealed, dtype=torch.int64)
        if not ((pages >= 0) & (pages < hashes.byte_hashes.shape[0])).all():
            return True, write_tags, slot_stamps  # not a page: the separate check names it
        found = sampled_page_hash_reference(hashes.pool_bytes, pages, hashes.offsets, hashes.coeffs)
        recorded = hashes.byte_hashes[pages]
        failed |= bool(((recorded != NO_BYTE_HASH) & (found != recorded)).any())
    return failed, write_tags, slot_stamps


class BatchCheck:
    """`check_batch_reference` as one C call, bound to one pool's tag table, stamps and (full mode) bytes,
    sample and recorded hashes; `applies` False where the call cannot run (no extension, not a CPU pool,
    a layout it does not read): the caller runs the separate checks."""

    def __init__(
        self,
        page_tags: torch.Tensor,
        page_size: int,
        stamps: torch.Tensor | None,
        hashes: PageHashes | None,
        backend: str | None = None,
    ) -> None:
        self.has_stamps = stamps is not None
        self.applies = (
            resolve_backend(page_tags.device, backend) == "torch"
            and batch_check_applies(page_tags, stamps, hashes)
            and (stamps is None or stamps.shape[1] == page_size)
            and (hashes is None or hashes.coeffs.numel() < MAX_HASH_TERMS)
        )
        self._pool_args = batch_check_pool_args(page_tags, page_size, stamps, hashes) if self.applies else ()

    def __call__(
        self, batch: BatchTensors, expected: list[int], sealed: list[int]
    ) -> tuple[bool, torch.Tensor, torch.Tensor | None] | None:
        """(is_bad, write_tags, slot_stamps) of `batch` against `expected` (flat, `_expected`) and, in full
        mode, the `sealed` pages; None where the C call does not apply to these tensors."""
        block_tables, context_lens, positions, slot_mapping = batch
        dtypes = (block_tables.dtype, context_lens.dtype, positions.dtype, slot_mapping.dtype)
        if not (
            dtypes in _DTYPES
            and block_tables.is_cpu and context_lens.is_cpu and positions.is_cpu and slot_mapping.is_cpu
            and block_tables.is_contiguous() and context_lens.is_contiguous()
            and positions.is_contiguous() and slot_mapping.is_contiguous()
            and block_tables.dim() == 2 and positions.dim() == 1
        ):  # fmt: skip
            return None
        num_rows, width = block_tables.shape
        num_tokens = positions.shape[0]
        if context_lens.shape != (num_rows,) or slot_mapping.shape != (num_tokens,):
            return None
        if len(expected) != 2 * (num_rows * width + num_rows + num_tokens):
            return None
        write_tags = torch.empty(num_tokens, dtype=torch.int64)
        slot_stamps = torch.empty(num_tokens, dtype=torch.int64) if self.has_stamps else write_tags
        is_bad = check_batch_native(
            self._pool_args, batch, array("q", expected), array("q", sealed), write_tags, slot_stamps
        )
        return is_bad, write_tags, slot_stamps if self.has_stamps else None


_DTYPES = {  # block tables, context lengths, positions, slot mapping
    (table, lens, torch.int64, torch.int64)
    for table in (torch.int32, torch.int64)
    for lens in (torch.int32, torch.int64)
}
