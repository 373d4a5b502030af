"""Is a folder a complete kvq output? Its manifest says so, and every shard has the size and sha256 the
manifest recorded when `kvq compress` wrote it; every file of the index has a valid header (the KV scales
file `kvq calibrate` adds included), and a calibration is there whole or not at all. Reads only; imports
kvq.checkpoint, kvq.compress and kvq.calibrate.scales_record.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvq.calibrate.scales_record import check_calibrated
from kvq.checkpoint.reader import INDEX_NAME, Checkpoint, read_json
from kvq.checkpoint.write import TMP_SUFFIX
from kvq.compress.manifest import MANIFEST_NAME, read_manifest
from kvq.compress.shard_files import file_sha256
from kvq.errors import KvqError

_FIX = "re-run the kvq compress command that wrote it (it rewrites every shard that does not match)"


def verify_output(root: Path) -> dict:
    """The manifest of `root` once every check passed; `KvqError` naming the first file that is wrong."""
    root = Path(root)
    if not root.is_dir():
        raise KvqError(f"{root}: no such directory; pass the output directory of kvq compress")
    manifest = read_manifest(root)
    if manifest is None:
        raise KvqError(
            f"{root}: no {MANIFEST_NAME}; kvq push publishes what kvq compress wrote: run kvq compress first"
        )
    if not manifest.get("complete") or not manifest.get("shards"):
        raise KvqError(f"{root / MANIFEST_NAME}: the kvq compress run did not finish; {_FIX}")
    leftovers = sorted(p.name for p in root.glob(f"*{TMP_SUFFIX}"))
    if leftovers:
        raise KvqError(
            f"{root / leftovers[0]}: a temporary file of a kvq job that is running or was killed; let it "
            "finish, or re-run it"
        )
    for name, record in sorted(manifest["shards"].items()):
        check_shard(root / name, record["bytes"], record["sha256"])
    ckpt = Checkpoint.open(root)  # every shard of the index present with a valid header, sizes consistent
    check_calibrated(root, manifest, index_weight_map(root), ckpt.config)
    return manifest


def index_weight_map(root: Path) -> dict[str, str]:
    """The index's tensor -> file map ({} for a single-file checkpoint without an index)."""
    path = Path(root) / INDEX_NAME
    return dict(read_json(path, "index").get("weight_map") or {}) if path.exists() else {}


def check_shard(path: Path, expected_bytes: int, expected_sha256: str) -> None:
    if not path.is_file():
        raise KvqError(f"{path}: missing; {MANIFEST_NAME} lists it as written; {_FIX}")
    size = path.stat().st_size
    if size != expected_bytes:
        raise KvqError(
            f"{path}: {size} bytes, but {MANIFEST_NAME} recorded {expected_bytes} when it was written "
            f"(truncated or replaced); {_FIX}"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        digest = file_sha256(fd)
    finally:
        os.close(fd)
    if digest != expected_sha256:
        raise KvqError(
            f"{path}: sha256 {digest[:16]}... but {MANIFEST_NAME} recorded {expected_sha256[:16]}... when it "
            f"was written (its bytes were altered); {_FIX}"
        )
