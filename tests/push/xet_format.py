"""The Xet storage formats a CAS server reads on upload, after the Xet protocol specification
(huggingface/xet-core spec/xorb.md, spec/shard.md, spec/api.md): xorbs (compressed chunks), shards (file
reconstructions), and the hex form of hashes in URLs. Enough to rebuild every uploaded file's bytes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import lz4.block
import lz4.frame

CHUNK_HEADER_BYTES = 8
SHARD_HEADER_BYTES = 48
ENTRY_BYTES = 48
BOOKEND = b"\xff" * 32
FLAG_WITH_VERIFICATION = 1 << 31
FLAG_WITH_METADATA_EXT = 1 << 30
NONE, LZ4, BYTE_GROUPING4_LZ4 = 0, 1, 2
_LZ4_FRAME_MAGIC = b"\x04\x22\x4d\x18"


def hash_to_str(digest: bytes) -> str:
    """api.md "Converting Hashes to Strings": each 8-byte part as a little-endian u64, in hex, in order."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", digest))


def _lz4(data: bytes, size: int) -> bytes:
    if data.startswith(_LZ4_FRAME_MAGIC):
        return lz4.frame.decompress(data)
    return lz4.block.decompress(data, uncompressed_size=size)


def _ungroup4(data: bytes) -> bytes:
    """Invert byte grouping: group g holds bytes g, g+4, g+8, ...; the first n % 4 groups are one longer."""
    n = len(data)
    sizes = [n // 4 + (1 if g < n % 4 else 0) for g in range(4)]
    out = bytearray(n)
    start = 0
    for g, size in enumerate(sizes):
        out[g::4] = data[start : start + size]
        start += size
    return bytes(out)


def xorb_chunks(xorb: bytes, count: int) -> list[bytes]:
    """The first `count` chunks of a serialized xorb, decompressed (xorb.md "Chunk Format")."""
    chunks, offset = [], 0
    for _ in range(count):
        version, compressed, scheme, size = (
            xorb[offset],
            int.from_bytes(xorb[offset + 1 : offset + 4], "little"),
            xorb[offset + 4],
            int.from_bytes(xorb[offset + 5 : offset + 8], "little"),
        )
        if version != 0:
            raise ValueError(f"chunk {len(chunks)} at byte {offset}: version {version}, expected 0")
        data = xorb[offset + CHUNK_HEADER_BYTES : offset + CHUNK_HEADER_BYTES + compressed]
        if scheme == NONE:
            raw = data
        elif scheme == LZ4:
            raw = _lz4(data, size)
        elif scheme == BYTE_GROUPING4_LZ4:
            raw = _ungroup4(_lz4(data, size))
        else:
            raise ValueError(f"chunk {len(chunks)}: unknown compression scheme {scheme}")
        if len(raw) != size:
            raise ValueError(f"chunk {len(chunks)}: {len(raw)} bytes decompressed, header says {size}")
        chunks.append(raw)
        offset += CHUNK_HEADER_BYTES + compressed
    return chunks


@dataclass(frozen=True)
class Segment:
    xorb_hash: str  # hex form, as in /v1/xorbs/default/{hash}
    chunk_start: int
    chunk_end: int  # exclusive
    num_bytes: int


@dataclass(frozen=True)
class FileInfo:
    file_hash: str
    sha256: str | None  # from the metadata extension, required on upload
    segments: list[Segment]


def shard_files(shard: bytes) -> list[FileInfo]:
    """The file info section of a shard (shard.md section 2), from the header to the bookend."""
    _tag, version, _footer_size = struct.unpack_from("<32sQQ", shard, 0)
    if version != 2:
        raise ValueError(f"shard header version {version}, expected 2")
    files, offset = [], SHARD_HEADER_BYTES
    while True:
        file_hash, flags, num_entries = struct.unpack_from("<32sII", shard, offset)
        offset += ENTRY_BYTES
        if file_hash == BOOKEND:
            return files
        segments = []
        for _ in range(num_entries):
            cas_hash, _cas_flags, num_bytes, start, end = struct.unpack_from("<32sIIII", shard, offset)
            segments.append(Segment(hash_to_str(cas_hash), start, end, num_bytes))
            offset += ENTRY_BYTES
        if flags & FLAG_WITH_VERIFICATION:
            offset += num_entries * ENTRY_BYTES
        sha256 = None
        if flags & FLAG_WITH_METADATA_EXT:
            sha256 = hash_to_str(shard[offset : offset + 32])  # stored as 4 u64s, like every hash
            offset += ENTRY_BYTES
        files.append(FileInfo(hash_to_str(file_hash), sha256, segments))


def rebuild(info: FileInfo, xorbs: dict[str, bytes]) -> bytes:
    """A file's bytes from its segments; `KeyError` names a xorb that was never uploaded."""
    parts = []
    for segment in info.segments:
        chunks = xorb_chunks(xorbs[segment.xorb_hash], segment.chunk_end)[segment.chunk_start :]
        data = b"".join(chunks)
        if len(data) != segment.num_bytes:
            raise ValueError(
                f"segment of xorb {segment.xorb_hash[:12]}: {len(data)} bytes, {segment.num_bytes} expected"
            )
        parts.append(data)
    data = b"".join(parts)
    if info.sha256 is not None and hashlib.sha256(data).hexdigest() != info.sha256:
        raise ValueError(f"file {info.file_hash[:12]}: rebuilt bytes do not have the shard's sha256")
    return data
