"""kvq inspect: per-kind totals equal the bytes actually stored (file sizes minus headers)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from kvq.checkpoint.reader import Checkpoint
from kvq.inspect import summarize
from tests.checkpoint.test_reader import make_sharded
from tests.test_cli_errors import run_kvq


def stored_tensor_bytes(root: Path) -> int:
    """File sizes minus the 8-byte length prefix and the JSON header, computed without kvq's reader."""
    total = 0
    for shard in root.glob("*.safetensors"):
        data = shard.read_bytes()
        (header_len,) = struct.unpack("<Q", data[:8])
        total += len(data) - 8 - header_len
    return total


def test_summary_totals_match_files(tmp_path: Path) -> None:
    root = make_sharded(tmp_path / "m")
    report = summarize(Checkpoint.open(root))
    assert report.total.bytes == stored_tensor_bytes(root) == 130 * 64 + 2 * 4 + 33 * 64 * 2 + 64 * 2
    assert report.format == "fp8-block" and report.num_shards == 3
    assert report.kinds["attention"].tensors == 2
    assert report.kinds["attention"].parameters == 130 * 64  # the scale is metadata, not parameters
    assert report.kinds["attention"].dtypes == ["F32", "F8_E4M3"]
    assert sum(r.bytes for r in report.kinds.values()) == report.total.bytes


def test_cli_json_and_table(tmp_path: Path) -> None:
    root = make_sharded(tmp_path / "m")
    result = run_kvq("inspect", str(root), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["total"]["bytes"] == stored_tensor_bytes(root)
    assert set(data["kinds"]) == {"attention", "embeddings", "norms"}
    table = run_kvq("inspect", str(root))
    assert table.returncode == 0
    assert "fp8-block" in table.stdout and f"({stored_tensor_bytes(root)} B)" in table.stdout
