"""A folder is pushed only when it is a complete kvq output: manifest complete, every shard's size and
sha256 as recorded, every indexed file readable; the error names the file."""

from __future__ import annotations

import json

import pytest

from kvq.errors import KvqError
from kvq.push.verify import verify_output

SHARD = "model-00002-of-00003.safetensors"


def test_a_complete_output_passes(folder) -> None:
    manifest = verify_output(folder)
    assert manifest["complete"] and SHARD in manifest["shards"] and "kv_calibration" in manifest


def test_a_truncated_shard_is_refused_naming_it(folder) -> None:
    path = folder / SHARD
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(KvqError, match=rf"{SHARD}: \d+ bytes, but kvq_manifest.json recorded \d+"):
        verify_output(folder)


def test_an_altered_shard_is_refused_naming_it(folder) -> None:
    path = folder / SHARD
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor, size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(
        KvqError, match=rf"{SHARD}: sha256 [0-9a-f]{{16}}\.\.\. but kvq_manifest.json recorded"
    ):
        verify_output(folder)


def test_a_missing_shard_or_manifest_or_unfinished_run_is_refused(folder) -> None:
    (folder / SHARD).unlink()
    with pytest.raises(KvqError, match=f"{SHARD}: missing"):
        verify_output(folder)
    manifest = json.loads((folder / "kvq_manifest.json").read_text())
    (folder / "kvq_manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(KvqError, match="did not finish"):
        verify_output(folder)
    (folder / "kvq_manifest.json").unlink()
    with pytest.raises(KvqError, match="no kvq_manifest.json; kvq push publishes what kvq compress wrote"):
        verify_output(folder)


def test_a_truncated_scales_file_is_refused(folder) -> None:
    path = folder / "kv_scales.safetensors"  # written by kvq calibrate, not a manifest shard
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(KvqError, match="kv_scales.safetensors"):
        verify_output(folder)
