"""One failed page check: which request, which page, what it expected and what it found.

Imports kvq.runtime.sequence and kvq.runtime.integrity.tags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvq.runtime.integrity.tags import format_tag
from kvq.runtime.sequence import Sequence

# "read": a page the request's block table names for this step; "write": the page its new K/V goes to
# (the slot mapping); "bytes": a sealed page whose sampled bytes no longer hash as they did when sealed.
MismatchKind = Literal["read", "write", "bytes"]


@dataclass(frozen=True)
class PageMismatch:
    seq: Sequence
    kind: MismatchKind
    logical_index: int
    page_id: int
    expected: int
    found: int | None  # None: the page id is not a page of the pool
    position: int | None = None  # "write": the token whose K/V was going there

    def message(self) -> str:
        """What failed, naming the page, its logical index and both values in hex."""
        where = f"page {self.page_id} (logical page {self.logical_index})"
        if self.kind == "bytes":
            return (
                f"KV integrity: {where} sampled-bytes hash expected {format_tag(self.expected)}, found "
                f"{format_tag(self.found)}: its K/V changed after it was sealed"
            )
        if self.kind == "write":
            return (
                f"KV integrity: the K/V of position {self.position} was to be written to {where}: "
                f"expected tag {format_tag(self.expected)}, found {format_tag(self.found)}"
            )
        return (
            f"KV integrity: {where} expected tag {format_tag(self.expected)}, found "
            f"{format_tag(self.found)}: the page is not this request's"
        )
