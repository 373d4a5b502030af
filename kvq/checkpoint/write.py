"""Atomic writes: every output goes to a temporary name in the same directory and is renamed when complete."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvq.checkpoint.reader import INDEX_NAME

if TYPE_CHECKING:
    import torch

TMP_SUFFIX = ".kvq-tmp"


def tmp_path(path: Path) -> Path:
    return path.with_name(path.name + TMP_SUFFIX)


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def save_safetensors_atomic(
    tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict | None = None
) -> int:
    """Write a safetensors file under a temporary name, fsync, rename; return its size in bytes."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = tmp_path(path)
    try:
        save_file(
            {k: v.contiguous() for k, v in tensors.items()},
            str(tmp),
            metadata={"format": "pt", **(metadata or {})},
        )
        # safetensors creates 0600 files whatever the umask; servers often read as another user.
        os.chmod(tmp, 0o644)
        _replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


def write_json_atomic(data: object, path: Path) -> None:
    write_text_atomic(json.dumps(data, indent=2, sort_keys=True) + "\n", path)


def write_text_atomic(text: str, path: Path) -> None:
    """Write UTF-8 text under a temporary name, fsync, rename."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        _replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def index_document(weight_map: Mapping[str, str], total_size: int) -> dict:
    """`model.safetensors.index.json`'s content, tensors in sorted order."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def write_index(root: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """Write `model.safetensors.index.json` with tensors in sorted order."""
    write_json_atomic(index_document(weight_map, total_size), Path(root) / INDEX_NAME)


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Write `data` under a temporary name, fsync, rename."""
    path = Path(path)
    tmp = tmp_path(path)
    try:
        tmp.write_bytes(data)
        _replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
