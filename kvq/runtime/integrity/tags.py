"""Page tags: the 64-bit value each physical KV page carries, binding it to what it holds.

A sealed (full) page carries `sealed_tag(chain hash of its prefix)`; a page being filled carries
`fill_tag(owner request, logical page index, allocation generation)`, the generation counting every page
taken from the free list, so no two allocations ever share a fill tag. `FREE_TAG` (0) marks a page with
no owner; as an expectation it checks nothing. Tags are signed int64, the dtype of the device tag table.
Pure functions; imports nothing.
"""

from __future__ import annotations

FREE_TAG = 0
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit values that spreads every input bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def to_int64(value: int) -> int:
    """A 64-bit pattern as the signed int64 a tensor stores."""
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def fill_tag(seq_id: int, logical_index: int, generation: int) -> int:
    """Tag of page `logical_index` of request `seq_id` while it is filled, taken at `generation`."""
    x = _mix((seq_id + _GOLDEN) & _MASK)
    x = _mix((x ^ (logical_index + 2 * _GOLDEN)) & _MASK)
    x = _mix((x ^ (generation + 3 * _GOLDEN)) & _MASK)
    return to_int64(x) or 1  # never FREE_TAG


def sealed_tag(page_hash: int) -> int:
    """Tag of a sealed page: its prefix chain hash (`block_manager.chain_hash`), never FREE_TAG."""
    return to_int64(page_hash) or 1


def format_tag(tag: int | None) -> str:
    """'0x' and 16 hex digits (the unsigned pattern), or 'no page' for an id outside the pool."""
    return "no page" if tag is None else f"0x{tag & _MASK:016x}"
