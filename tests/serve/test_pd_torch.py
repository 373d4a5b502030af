"""The prefill/decode split over torch.distributed (`--pd-transport torch`, what runs between hosts), on
loopback: a real `kvq serve --role decode --pd-transport torch --pd-addr 127.0.0.1:PORT` worker and a
prefill worker in this process, pages inside the messages of a gloo group of their own. Greedy outputs
equal one engine's (fp32 reference mode); a page corrupted in transit ends only its request; a decode
worker killed mid-request fails its in-flight requests and the prefill side keeps serving; bad transport
options are one-line errors."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvq.runtime.engine import Engine
from kvq.serve.pd_roles import PrefillFront, stop_child
from tests.runtime.test_kv_transfer import prompts
from tests.serve.test_pd_split import (
    FLAGS,
    GREEDY,
    assert_a_page_corrupted_in_transit_ends_its_request,
    assert_a_vanished_decode_worker_fails_only_in_flight,
    config,
)
from tests.test_cli_errors import assert_one_line_error

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_split_over_torch_distributed(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    llama = tiny_checkpoint("llama", "bf16")
    addr = f"127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "kvq", "serve", str(llama), *FLAGS, "--role", "decode"]
    child = subprocess.Popen([*argv, "--pd-transport", "torch", "--pd-addr", addr])
    try:
        expected = [o.token_ids for o in Engine(config(llama)).generate(prompts(), GREEDY)]
        front = PrefillFront(config(llama), None, pd_addr=addr)  # waits for the worker's store
        outputs = front.generate(prompts(), GREEDY)
        assert [o.token_ids for o in outputs] == expected
        assert front.num_handoffs == len(prompts()) and front.handoff_bytes > 0
        assert_a_page_corrupted_in_transit_ends_its_request(front, expected, monkeypatch)
        assert_a_vanished_decode_worker_fails_only_in_flight(front, child, expected)
    finally:
        stop_child(child)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--role", "decode", "--pd-transport", "torch"], "--pd-transport torch needs --pd-addr HOST:PORT"),
        (["--role", "prefill", "--pd-transport", "torch", "--pd-addr", "nohost"], "--pd-addr is 'nohost'"),
        (["--role", "decode", "--pd-transport", "udp"], "--pd-transport is 'udp'; pick shm or torch"),
        (
            ["--role", "decode", "--pd-socket", "x.sock", "--tp", "2"],
            "the prefill/decode split runs at --tp 1",
        ),
    ],
)
def test_bad_torch_transport_options_are_one_line_errors(
    tmp_path: Path, args: list[str], fragment: str
) -> None:
    command = [sys.executable, "-m", "kvq", "serve", str(tmp_path), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, fragment)
