"""What `kvq calibrate` adds to a checkpoint, by name, and whether a folder holds all of it.

A calibration lands as one unit (`kvq.checkpoint.file_commit`): `kv_scales.safetensors`, the index that
names it, config.json's `kv_cache_scheme`, and the manifest's `kv_calibration` record with the scales
file's size and sha256 (`kv_scales_file`), the manifest last. `check_calibrated` finds a folder where
those disagree (a run killed by an older kvq, a file replaced by hand). Imports the standard library
and kvq only: `kvq push` uses it without torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvq.checkpoint.model_config import quantization_config_of
from kvq.checkpoint.reader import CONFIG_NAME, INDEX_NAME
from kvq.errors import KvqError

SCALES_FILE = "kv_scales.safetensors"
MANIFEST_NAME = "kvq_manifest.json"
MANIFEST_KEY = "kv_calibration"
FILE_KEY = "kv_scales_file"  # {"name", "bytes", "sha256"} of the scales file as written
UNIT_FILES = (SCALES_FILE, INDEX_NAME, CONFIG_NAME, MANIFEST_NAME)  # one calibration, in the order it lands

_FIX = "re-run the kvq calibrate command (it completes the calibration), or start again from kvq compress"


def file_record(data: bytes) -> dict:
    return {"name": SCALES_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_calibrated(root: Path, manifest: dict, weight_map: dict[str, str], config: dict) -> None:
    """`KvqError` unless the scales file, index, config.json and manifest all agree on the calibration
    (or none of them mentions one)."""
    record = manifest.get(MANIFEST_KEY)
    scales = Path(root) / SCALES_FILE
    is_indexed = SCALES_FILE in set(weight_map.values())
    if record is None and not is_indexed and not scales.exists():
        return
    where = f"{root}: half-calibrated"
    if record is None:
        raise KvqError(f"{where}: {SCALES_FILE} is there but {MANIFEST_NAME} records no calibration; {_FIX}")
    if not scales.is_file() or not is_indexed:
        state = "is not in the index" if scales.is_file() else "is missing"
        raise KvqError(f"{where}: {MANIFEST_NAME} records a calibration but {SCALES_FILE} {state}; {_FIX}")
    if "kv_cache_scheme" not in quantization_config_of(config):
        raise KvqError(
            f"{where}: {MANIFEST_NAME} records a calibration but config.json has no kv_cache_scheme; {_FIX}"
        )
    written = manifest.get(FILE_KEY)
    if written is not None and file_record(scales.read_bytes()) != written:
        raise KvqError(
            f"{where}: {SCALES_FILE} is not the file {MANIFEST_NAME} recorded (size or sha256 differ); {_FIX}"
        )
