"""Shared terminal rendering for commands: a rich console on stdout and human-readable counts (sizes:
`kvq.byte_sizes.format_bytes`)."""

from __future__ import annotations

from rich.console import Console

# soft_wrap: a line longer than the width (a long path, piped into a log at rich's 80 columns) is printed
# whole, not broken where a script that reads it would not expect; tables still fit the width.
console = Console(highlight=False, soft_wrap=True)


def human_count(n: float) -> str:
    """1_234_567 -> '1.23M'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))
