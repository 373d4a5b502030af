"""The integrity kernels' C calls on CPU (`cpu/_ops_stamps.h`): the step check and the write guard
(`step_check`), the slot-stamp check (`stamp_check`), the sampled-bytes page hash (`page_check`), one
call each, and the three at once answering only pass or fail (`batch_check`). Exact integer arithmetic, so
the same values as the torch references wherever the extension is built, at any ISA. `*_applies` says when
a C call runs (CPU tensors of the dtypes, shapes and layout it reads); anything else goes to the reference,
which names what is wrong. Imports torch and the `_ops` extension only.
"""

from __future__ import annotations

import importlib
from array import array
from types import ModuleType

import torch

# `step_check.StepCheckInputs`, `batch_check.BatchTensors` or `batch_check.PageHashes`, in their order
StepTensors = tuple[torch.Tensor, ...]

_ext: ModuleType | None
try:
    _ext = importlib.import_module("kvq.runtime.kernels.cpu._ops")
except ImportError:  # no C compiler at install: torch only
    _ext = None
_INTEGER = (torch.int32, torch.int64)


def step_check_applies(inputs: StepTensors, writers: torch.Tensor | None) -> bool:
    """True when `check_step_native` runs: the extension has the op; every tensor on the CPU, contiguous,
    int64 (block_tables and context_lens int32 or int64) and of `check_step`'s shapes."""
    if _ext is None or not hasattr(_ext, "check_step"):
        return False
    page_tags, block_tables, context_lens, positions = inputs[:4]
    if block_tables.dim() != 2 or positions.dim() != 1 or page_tags.dim() != 1:
        return False
    table, rows, tokens = tuple(block_tables.shape), (block_tables.shape[0],), tuple(positions.shape)
    tensors = [*inputs[1:], *([] if writers is None else [writers])]  # block_tables onwards
    shapes = [table, rows, tokens, tokens, table, rows, tokens, tokens, table]
    int64 = [page_tags, *tensors[2:]]
    return (
        all(tuple(t.shape) == shape for t, shape in zip(tensors, shapes, strict=False))
        and all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" for t in int64)
        and all(t.dtype in _INTEGER and t.device.type == "cpu" for t in (block_tables, context_lens))
        and block_tables.stride(1) == 1
        and context_lens.is_contiguous()
    )


def check_step_native(
    inputs: StepTensors, page_size: int, writers: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`step_check.check_step_reference` as one C call (`step_check_applies`)."""
    assert _ext is not None
    page_tags, block_tables, context_lens, positions, slot_mapping = inputs[:5]
    num_rows, width = block_tables.shape
    num_tokens = positions.shape[0]
    is_bad = torch.empty(num_rows * width + num_rows + num_tokens, dtype=torch.bool)
    write_tags = torch.empty(num_tokens, dtype=torch.int64)
    slot_stamps = None if writers is None else torch.empty(num_tokens, dtype=torch.int64)
    _ext.check_step(
        page_tags.data_ptr(), page_tags.shape[0],
        block_tables.data_ptr(), block_tables.stride(0), int(block_tables.dtype == torch.int64),
        context_lens.data_ptr(), int(context_lens.dtype == torch.int64), num_rows, width,
        positions.data_ptr(), slot_mapping.data_ptr(), *(t.data_ptr() for t in inputs[5:]), num_tokens,
        page_size, 0 if writers is None else writers.data_ptr(), is_bad.data_ptr(), write_tags.data_ptr(),
        0 if slot_stamps is None else slot_stamps.data_ptr(),
    )  # fmt: skip
    return is_bad, write_tags, slot_stamps


def guard_applies(page_tags: torch.Tensor, slot_mapping: torch.Tensor, write_tags: torch.Tensor) -> bool:
    """True when `guard_native` runs: the extension has the op; CPU, contiguous int64 `[P]`, `[T]`, `[T]`."""
    tensors = (page_tags, slot_mapping, write_tags)
    return (
        _ext is not None
        and hasattr(_ext, "guard_slots")
        and page_tags.dim() == slot_mapping.dim() == 1
        and page_tags.numel() > 0
        and write_tags.shape == slot_mapping.shape
        and all(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    )


def guard_native(
    page_tags: torch.Tensor, slot_mapping: torch.Tensor, write_tags: torch.Tensor, page_size: int
) -> torch.Tensor:
    """`step_check.guard_slot_mapping` as one C call (`guard_applies`)."""
    assert _ext is not None
    out = torch.empty_like(slot_mapping)
    _ext.guard_slots(
        page_tags.data_ptr(), page_tags.shape[0], slot_mapping.data_ptr(), write_tags.data_ptr(),
        slot_mapping.shape[0], page_size, out.data_ptr(),
    )  # fmt: skip
    return out


def page_hash_applies(
    pool_bytes: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, coeffs: torch.Tensor
) -> bool:
    """True when `sampled_page_hash_native` runs: the extension has the op; CPU uint8 `[L, C, P1, R]`
    with each part's bytes contiguous, int page ids `[N]`, contiguous int64 offsets `[S]`, coeffs
    `[L, C, S]`."""
    return (
        _ext is not None
        and hasattr(_ext, "sampled_page_hash")
        and pool_bytes.dim() == 4
        and pool_bytes.dtype == torch.uint8
        and pool_bytes.stride(3) == 1
        and page_ids.dim() == offsets.dim() == 1
        and page_ids.dtype in _INTEGER
        and page_ids.is_contiguous()
        and tuple(coeffs.shape) == (*pool_bytes.shape[:2], offsets.shape[0])
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in (offsets, coeffs))
        and all(t.device.type == "cpu" for t in (pool_bytes, page_ids, offsets, coeffs))
    )


def sampled_page_hash_native(
    pool_bytes: torch.Tensor, page_ids: torch.Tensor, offsets: torch.Tensor, coeffs: torch.Tensor
) -> torch.Tensor:
    """`page_check.sampled_page_hash_reference` as one C call (`page_hash_applies`)."""
    assert _ext is not None
    num_layers, num_parts, num_slot_pages = pool_bytes.shape[:3]
    out = torch.empty(page_ids.shape[0], dtype=torch.int64)
    _ext.sampled_page_hash(
        pool_bytes.data_ptr(), num_layers, num_parts, num_slot_pages, *pool_bytes.stride()[:3],
        page_ids.data_ptr(), int(page_ids.dtype == torch.int64), page_ids.shape[0],
        offsets.data_ptr(), offsets.shape[0], coeffs.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out


def stamps_check_applies(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> bool:
    """True when `check_stamps_native` runs (an exact compare: wherever the extension is built): CPU,
    contiguous int64 stamps, writers and lengths of the shapes `kernels.integrity.stamp_check` takes, block
    tables int32/int64 with unit inner stride."""
    return (
        _ext is not None
        and stamps.device.type == "cpu"
        and stamps.dim() == 3
        and block_tables.dim() == 2
        and stamps.dtype == expected_writers.dtype == read_lens.dtype == torch.int64
        and block_tables.dtype in _INTEGER
        and stamps.is_contiguous()
        and expected_writers.is_contiguous()
        and read_lens.is_contiguous()
        and (block_tables.stride(1) == 1 or block_tables.shape[1] <= 1)
        and tuple(expected_writers.shape) == tuple(block_tables.shape)
        and tuple(read_lens.shape) == (block_tables.shape[0],)
        and block_tables.device.type == expected_writers.device.type == read_lens.device.type == "cpu"
    )


def check_stamps_native(
    stamps: torch.Tensor, block_tables: torch.Tensor, expected_writers: torch.Tensor, read_lens: torch.Tensor
) -> torch.Tensor:
    """`kernels.integrity.stamp_check.check_stamps_reference` as one C call (`stamps_check_applies`)."""
    assert _ext is not None
    num_rows, width = block_tables.shape
    out = torch.empty(num_rows, dtype=torch.int64)
    _ext.check_stamps(
        stamps.data_ptr(),
        stamps.shape[0],
        stamps.shape[1],
        stamps.shape[2],
        block_tables.data_ptr(),
        block_tables.stride(0),
        int(block_tables.dtype == torch.int64),
        expected_writers.data_ptr(),
        read_lens.data_ptr(),
        num_rows,
        width,
        out.data_ptr(),
    )
    return out


def batch_check_applies(
    page_tags: torch.Tensor, stamps: torch.Tensor | None, hashes: StepTensors | None
) -> bool:
    """True when `check_batch_native` can run for a pool (its batches are checked per call): the extension
    has the op; CPU, contiguous int64 tags `[P]` and stamps `[P1, page_size, L]`; with `hashes`
    (`batch_check.PageHashes`) the layouts `page_hash_applies` takes and contiguous int64 hashes `[P]`."""
    if _ext is None or not hasattr(_ext, "check_batch"):
        return False
    if page_tags.device.type != "cpu" or page_tags.dtype != torch.int64 or not page_tags.is_contiguous():
        return False
    if stamps is not None and not (
        stamps.is_cpu and stamps.dim() == 3 and stamps.dtype == torch.int64 and stamps.is_contiguous()
    ):
        return False
    if hashes is None:
        return True
    pool_bytes, offsets, coeffs, byte_hashes = hashes
    no_pages = torch.zeros(0, dtype=torch.int64)
    return (
        page_hash_applies(pool_bytes, no_pages, offsets, coeffs)
        and byte_hashes.dtype == torch.int64
        and byte_hashes.is_contiguous()
        and byte_hashes.device.type == "cpu"
        and tuple(byte_hashes.shape) == tuple(page_tags.shape)
    )


def batch_check_pool_args(
    page_tags: torch.Tensor, page_size: int, stamps: torch.Tensor | None, hashes: StepTensors | None
) -> tuple[int, ...]:
    """`check_batch`'s first arguments, the pool's (`batch_check_applies`): bound once per pool."""
    stamp_args = (0, 0, 0) if stamps is None else (stamps.data_ptr(), *stamps.shape[::2])
    if hashes is None:
        hash_args: tuple[int, ...] = (0,) * 11
    else:
        pool_bytes, offsets, coeffs, byte_hashes = hashes
        hash_args = (
            pool_bytes.data_ptr(), *pool_bytes.shape[:3], *pool_bytes.stride()[:3],
            offsets.data_ptr(), offsets.shape[0], coeffs.data_ptr(), byte_hashes.data_ptr(),
        )  # fmt: skip
    return (page_tags.data_ptr(), page_tags.shape[0], page_size, *stamp_args, *hash_args)


def check_batch_native(
    pool_args: tuple[int, ...],
    batch: StepTensors,
    expected: array,
    sealed: array,
    write_tags: torch.Tensor,
    slot_stamps: torch.Tensor,
) -> bool:
    """`batch_check.check_batch_reference` as one C call: `pool_args` (`batch_check_pool_args`), the batch's
    block tables, context lengths, positions and slot mapping (CPU; block tables and lengths int32 or int64,
    the rest contiguous int64), the flat expectations and the sealed pages as int64 arrays; writes
    `write_tags` and `slot_stamps` (contiguous int64 `[T]`)."""
    assert _ext is not None
    block_tables, context_lens, positions, slot_mapping = batch
    num_rows, width = block_tables.shape
    step_args = (
        block_tables.data_ptr(), block_tables.stride(0), block_tables.dtype == torch.int64,
        context_lens.data_ptr(), context_lens.dtype == torch.int64, num_rows, width,
        positions.data_ptr(), slot_mapping.data_ptr(), positions.shape[0], expected.buffer_info()[0],
        sealed.buffer_info()[0], len(sealed), write_tags.data_ptr(), slot_stamps.data_ptr(),
    )  # fmt: skip
    return bool(_ext.check_batch(*pool_args, *step_args))
