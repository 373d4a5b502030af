"""Keep a long layer-streaming run at one layer's worth of memory on CPU.

Two process-level caches otherwise grow layer after layer: oneDNN's primitive cache (bf16 matmuls on
CPU; every routed expert sees a new token count, so a new primitive with its own scratchpad is cached)
and glibc's heap, which keeps freed layer-sized regions mapped. `limit_primitive_cache()` turns the
former off (before the first matmul of the process; later calls change nothing) and `release_freed()`
hands the latter back after each layer. Standard library only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc_name = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_libc_name) if _libc_name else None


def limit_primitive_cache() -> None:
    """Disable oneDNN's primitive cache unless the user configured it (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")


def release_freed() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim`); a no-op elsewhere."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
