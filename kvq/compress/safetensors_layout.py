"""The exact bytes of a safetensors header, and every tensor's offset, before any tensor exists.

Reproduces the `safetensors` serializer: tensors ordered by dtype (widest alignment first, in the crate's
`Dtype` enum order, descending) then by name; compact JSON with `__metadata__` first; the JSON padded with
spaces to a multiple of 8. So `kvq plan` predicts file sizes to the byte, and a shard can be written
tensor by tensor at known offsets (never held whole in memory) yet be byte-identical to `save_file`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvq.compress.tensor_plan import OutputTensor

# safetensors' `Dtype` enum, highest first (observed with safetensors 0.8; tested against save_file).
DTYPE_ORDER = (
    "U64",
    "I64",
    "F64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E8M0",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)
_DTYPE_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_ORDER)}
METADATA = {"format": "pt"}


@dataclass(frozen=True)
class ShardLayout:
    """A safetensors file laid out in advance: its header bytes and each tensor's absolute data offset."""

    header: bytes  # 8-byte little-endian length + padded JSON
    offsets: dict[str, int]
    tensors: dict[str, OutputTensor]
    file_bytes: int

    @property
    def tensor_bytes(self) -> int:
        return self.file_bytes - len(self.header)

    def subset(self, names: Iterable[str]) -> ShardLayout:
        """The offsets and tensors of `names` only (no header): what a part writer needs."""
        names = list(names)
        offsets = {name: self.offsets[name] for name in names}
        return ShardLayout(b"", offsets, {name: self.tensors[name] for name in names}, self.file_bytes)


def shard_layout(tensors: Sequence[OutputTensor], metadata: dict[str, str] | None = None) -> ShardLayout:
    """Lay out `tensors` exactly as `safetensors.torch.save_file` would."""
    ordered = sorted(tensors, key=lambda t: (_DTYPE_RANK[t.dtype], t.name))
    entries: dict[str, object] = {"__metadata__": dict(metadata or METADATA)}
    relative: dict[str, int] = {}
    offset = 0
    for t in ordered:
        entries[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        relative[t.name] = offset
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    offsets = {name: len(header) + rel for name, rel in relative.items()}
    return ShardLayout(header, offsets, {t.name: t for t in ordered}, len(header) + offset)
