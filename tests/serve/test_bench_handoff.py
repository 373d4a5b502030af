"""`kvq bench handoff` end to end on both transports (tiny lengths, one repeat): every stage measured and
the JSON names the transport. Values only; nothing is timed against a bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.test_tensor_parallel import _kvq

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("transport", ["shm", "torch"])
def test_bench_handoff_measures_every_stage(transport: str, tmp_path: Path) -> None:
    out = tmp_path / "handoff.json"
    args = ["bench", "handoff", "--transport", transport, "--prompt-tokens", "33", "--repeats", "1"]
    done = _kvq(*args, "--threads", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["config"]["transport"] == transport
    us = result["us_per_token"]["33"]
    stages = ("export", "send", "receive", "verify", "admit")
    assert all(us[stage] > 0 for stage in (*stages, "prefill step"))
    assert us["total"] == pytest.approx(sum(us[stage] for stage in stages))
    assert (
        result["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    )  # SmolLM2: layers, K/V, KV heads, head dim, bf16
