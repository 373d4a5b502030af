"""The prefill/decode split across two processes: a real `kvq serve --role decode` worker on a Unix socket,
pages through shared memory. Greedy outputs equal one engine's (fp32 reference mode); a decode worker that
is killed fails its in-flight requests with an error and the prefill side keeps serving; a decode worker
on another model refuses the prefill worker by field name; `kvq serve --role pd` (one command) answers
over HTTP as a single engine does."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kv_transfer import KVHandoff
from kvq.runtime.sampling import SamplingParams
from kvq.serve import pd_roles
from kvq.serve.pd_link import send_handoff
from kvq.serve.pd_roles import PrefillFront, stop_child
from tests.runtime.test_kv_transfer import prompts
from tests.serve.cli_server import kvq_serve
from tests.test_cli_errors import assert_one_line_error

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
OPTIONS = {"dtype": "float32", "kv_memory": "4MiB", "page_size": 4, "threads": 1}
FLAGS = ["--dtype=float32", "--kv-memory=4MiB", "--page-size=4", "--threads=1"]


def config(path: Path) -> EngineConfig:
    return EngineConfig(model=str(path), **OPTIONS)  # type: ignore[arg-type]


def decode_worker(path: Path, socket_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvq", "serve", str(path), *FLAGS, "--role", "decode"]
    child = subprocess.Popen([*argv, "--pd-socket", str(socket_path)])
    deadline = time.monotonic() + 180
    while not socket_path.exists():
        assert child.poll() is None, "the decode worker exited"
        assert time.monotonic() < deadline, "the decode worker did not listen in time"
        time.sleep(0.1)
    return child


def assert_a_page_corrupted_in_transit_ends_its_request(
    front: PrefillFront, expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte flipped on the way (after its digest was taken): the decode worker refuses that request only."""

    def corrupting(conn, request_id: int, handoff: KVHandoff, params: SamplingParams) -> None:  # noqa: ANN001
        if handoff.prompt_token_ids == prompts()[2]:
            handoff.pages[1].data[0, 1, 7] ^= 0x01
        send_handoff(conn, request_id, handoff, params)

    monkeypatch.setattr(pd_roles, "send_handoff", corrupting)
    outputs = front.generate(prompts(), GREEDY)
    assert outputs[2].finish_reason == "error" and "bytes digest" in (outputs[2].error or "")
    assert [o.token_ids for i, o in enumerate(outputs) if i != 2] == expected[:2] + expected[3:]
    monkeypatch.undo()


def assert_a_vanished_decode_worker_fails_only_in_flight(
    front: PrefillFront, child: subprocess.Popen, expected: list[list[int]]
) -> None:
    """In flight on the decode worker when it is killed: those requests end with an error, in bounded
    time, and the prefill side keeps serving (new requests decode there)."""
    slow = SamplingParams(max_tokens=200, ignore_eos=True)
    handed_off = front.num_handoffs
    ids = [front.add_request(p, slow) for p in prompts()[2:4]]
    while front.num_handoffs < handed_off + 2:
        front.step()
    child.kill()
    child.wait(timeout=30)
    finished, deadline = {}, time.monotonic() + 60
    while len(finished) < 2 and time.monotonic() < deadline:
        finished.update({o.request_id: o for o in front.step() if o.finished})
    assert sorted(finished) == sorted(ids)
    assert all(
        o.finish_reason == "error" and "decode worker went away" in (o.error or "") for o in finished.values()
    )
    assert front.link is None
    assert [o.token_ids for o in front.generate(prompts(), GREEDY)] == expected
    assert front.block_manager.num_free_pages == front.kv_pool.num_pages


@pytest.fixture
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "bf16")


@pytest.fixture
def worker(llama: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    socket_path = tmp_path / "decode.sock"
    child = decode_worker(llama, socket_path)
    yield child, socket_path
    stop_child(child)


def test_split_over_shared_memory_then_a_vanished_decode_worker(
    llama: Path, worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    child, socket_path = worker
    expected = [o.token_ids for o in Engine(config(llama)).generate(prompts(), GREEDY)]
    front = PrefillFront(config(llama), str(socket_path))
    outputs = front.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert front.num_handoffs == len(prompts()) and front.handoff_bytes > 0

    assert_a_page_corrupted_in_transit_ends_its_request(front, expected, monkeypatch)
    assert_a_vanished_decode_worker_fails_only_in_flight(front, child, expected)


def test_a_decode_worker_on_another_model_refuses_by_field(tiny_checkpoint, worker) -> None:
    _, socket_path = worker
    with pytest.raises(
        KvqError, match=r"refused this prefill worker: .*disagree on the KV cache .*model_type"
    ):
        PrefillFront(config(tiny_checkpoint("glm4_moe", "bf16")), str(socket_path))


def test_the_one_command_mode_answers_as_one_engine(llama: Path) -> None:
    prompt = prompts()[3]
    expected = Engine(config(llama)).generate([prompt], SamplingParams(max_tokens=5))[0]
    args = [str(llama), *FLAGS, "--role", "pd", "--served-model-name", "tiny"]
    with kvq_serve(args, timeout_s=600) as url:  # two engines load, one after the other
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert reply["choices"][0]["text"] == expected.text
        assert reply["usage"]["completion_tokens"] == len(expected.token_ids)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--role", "decode"], "--role decode needs --pd-socket PATH"),
        (["--role", "prefill"], "--role prefill needs --pd-socket PATH"),
        (["--role", "bogus"], "--role is 'bogus'; pick one of single, prefill, decode, pd"),
    ],
)
def test_bad_roles_are_one_line_errors(tmp_path: Path, args: list[str], fragment: str) -> None:
    command = [sys.executable, "-m", "kvq", "serve", str(tmp_path), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, fragment)


def test_a_prefill_worker_without_its_decode_worker_names_the_socket(llama: Path, tmp_path: Path) -> None:
    socket_path = tmp_path / "none.sock"
    with pytest.raises(KvqError, match=rf"{socket_path}: no decode worker answers there"):
        PrefillFront(config(llama), str(socket_path))
