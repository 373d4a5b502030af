"""Which part of each stored tensor a tensor-parallel rank loads: pure functions from full shapes to
slices. Column-parallel layers (q/k/v, gate/up, experts' gate/up) split the weight's rows (outputs),
row-parallel ones (o, down) its columns (inputs); INT4 splits on group boundaries, FP8 blocks on block
boundaries, and a share that is not a whole number of them is a `KvqError` naming the tensor.
Imports kvq.errors and kvq.runtime.distributed.group only.
"""

from __future__ import annotations

from kvq.errors import KvqError
from kvq.runtime.distributed.group import TpGroup

Index = tuple[slice, ...]
ROWS, COLS = "rows", "cols"  # what a layer splits: column-parallel its rows, row-parallel its columns
ALL: Index = (slice(None),)


def index(split: str, start: int, stop: int) -> Index:
    """The slice of a 2-D (or, for ROWS, 1-D) tensor: rows or columns [start, stop)."""
    return (slice(start, stop),) if split == ROWS else (slice(None), slice(start, stop))


def span(tp: TpGroup, size: int, unit: int, what: str, unit_name: str) -> tuple[int, int]:
    """This rank's [start, stop) of `size`, split evenly in whole `unit`s."""
    start, stop = tp.shard(size, what)
    if (stop - start) % unit:
        raise KvqError(
            f"{what}: {size} over {tp.size} tensor-parallel ranks is {stop - start} each, not a whole "
            f"number of {unit_name}s of {unit}; pick a --tp that gives every rank whole {unit_name}s"
        )
    return start, stop


def dim_of(split: str) -> int:
    return 0 if split == ROWS else 1


def dense_index(tp: TpGroup, split: str, shape: tuple[int, ...], name: str) -> Index:
    start, stop = span(tp, shape[dim_of(split)], 1, f"{name} {split} ({shape})", "row")
    return index(split, start, stop)


def int4_indexes(
    tp: TpGroup, split: str, shape: tuple[int, int], scale_cols: int, prefix: str
) -> tuple[Index, Index]:
    """(weight_packed's, weight_scale's) slices of an INT4 weight of logical `shape` `[N, K]`."""
    if split == ROWS:
        start, stop = span(tp, shape[0], 1, f"{prefix}.weight_packed rows ({shape[0]})", "row")
        return index(ROWS, start, stop), index(ROWS, start, stop)
    group_size = shape[1] // scale_cols
    what = f"{prefix}.weight_packed columns ({shape[1]}, group size {group_size})"
    start, stop = span(tp, shape[1], group_size, what, "group")
    return index(COLS, start // 8, stop // 8), index(COLS, start // group_size, stop // group_size)


def fp8_indexes(
    tp: TpGroup,
    split: str,
    shape: tuple[int, int],
    scale_shape: tuple[int, ...],
    block: tuple[int, int],
    prefix: str,
    scale_name: str,
) -> tuple[Index, Index]:
    """(weight's, scale's) slices of an FP8 weight `[N, K]` with a block, channel or tensor scale."""
    dim = dim_of(split)
    size = shape[dim]
    scale_size = scale_shape[dim] if len(scale_shape) == 2 else 1
    if scale_size == 1:  # one scale along this dimension (per tensor, or per channel of the other one)
        start, stop = span(tp, size, 1, f"{prefix}.weight {split} ({size})", "row")
        return index(split, start, stop), ALL
    if scale_size == size:  # per channel along this dimension
        start, stop = span(tp, size, 1, f"{prefix}.weight {split} ({size})", "row")
        return index(split, start, stop), index(split, start, stop)
    unit = block[dim]
    what = f"{prefix}.weight {split} ({size}, FP8 block {block[0]}x{block[1]}, scale {scale_name})"
    start, stop = span(tp, size, unit, what, "block")
    return index(split, start, stop), index(split, start // unit, -(-stop // unit))
