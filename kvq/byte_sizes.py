"""Byte sizes on the command line, one convention for every flag (vLLM's and Kubernetes'): decimal units
are powers of 1000 (`GB` = `G` = 10^9), binary ones powers of 1024 (`GiB` = `Gi` = 2^30), a bare number
is bytes; decimals are allowed (`1.5GiB`). Imports kvq.errors only (no torch: `kvq plan` stays light).
"""

from __future__ import annotations

import re

from kvq.errors import KvqError

# Appended to the help of every option that takes a size, so each says the convention.
SIZE_HELP = (
    "Units: KB/MB/GB/TB (or K/M/G/T) are powers of 1000, KiB/MiB/GiB/TiB (Ki...) of 1024; none: bytes."
)
_PREFIXES = "KMGT"
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?:([KMGT])(i?)B?|(B?))\s*", re.IGNORECASE)
_EXAMPLES = "e.g. 512MiB, 24GB, 1.5GiB or 1073741824"


def parse_bytes(value: str | int, flag: str) -> int:
    """'24GB' -> 24 * 10^9, '24GiB' -> 24 * 2^30, '2G' -> 2 * 10^9, '4096' or 4096 -> 4096.

    Raises `KvqError` naming `flag` (e.g. "--kv-memory") for anything else, or a size that is not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise KvqError(f"{flag}: expected a size ({_EXAMPLES}), found {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        if match is None:
            raise KvqError(f"{flag}: {value!r} is not a size; give one like {_EXAMPLES} ({SIZE_HELP})")
        number, prefix, binary = float(match[1]), match[2], match[3]
        base = 1024 if binary else 1000
        size = int(number * base ** (_PREFIXES.index(prefix.upper()) + 1)) if prefix else int(number)
    if size <= 0:
        raise KvqError(f"{flag}: must be a positive size, found {value!r} ({_EXAMPLES})")
    return size


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB', 2**30 -> '1.00 GiB': binary units, as kvq's tables print sizes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
