"""The two roles of `kvq serve --role prefill|decode` (and `--role pd`, which starts both).

`PrefillFront` is the engine behind the prefill worker's HTTP API: each request runs its prefill step
here; unless its first token finished it, its pages are handed to the decode worker (`pd_link`) and the
decode worker's outputs come back as this engine's outputs, so `AsyncEngine` and the HTTP app serve it as
any engine. If the decode worker goes away, its in-flight requests end with finish reason "error" and a
message saying so, and this worker keeps serving: later requests decode here. `run_decode_worker` is the
decode worker's loop: one prefill worker at a time, requests admitted as their pages arrive.
Imports torch and kvq.runtime.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import RequestOutput
from kvq.runtime.kv_transfer import KvTransferError, check_same_kv
from kvq.runtime.pd_engine import PDEngine
from kvq.runtime.sampling import SamplingParams
from kvq.runtime.sequence import Sequence
from kvq.serve.pd_link import connect, receive_handoff, send_handoff

log = logging.getLogger("kvq.serve")
IDLE_POLL_S = 0.005  # how long a step with only remote requests waits for the decode worker's outputs


class PrefillFront(PDEngine):
    def __init__(self, config: EngineConfig, socket_path: str | None) -> None:
        super().__init__(config)
        self.link: Connection | None = None
        if socket_path is not None:
            self.link = connect(socket_path, self.kv_identity, str(self.ckpt.root))
        self._params: dict[int, SamplingParams] = {}  # local requests not yet prefilled
        self._remote: dict[int, RequestOutput] = {}  # handed off -> its last output here
        self.num_handoffs = 0
        self.handoff_bytes = 0

    def _queue(self, seq: Sequence) -> None:
        super()._queue(seq)
        self._params[seq.seq_id] = seq.params

    def abort(self, request_id: int) -> bool:
        self._params.pop(request_id, None)
        if self._remote.pop(request_id, None) is not None:
            self._send(("abort", request_id))
            return True
        return super().abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._remote) or super().has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = []
        for out in super().step():
            params = self._params.pop(out.request_id, None)
            if params is not None and not out.finished and self.link is not None:
                handoff = self.hand_off(out.request_id)
                if self._send_handoff(out.request_id, handoff, params):
                    self._remote[out.request_id] = out
                    self.num_handoffs += 1
                    self.handoff_bytes += handoff.num_bytes
                    continue
                outputs.append(self._lost(out))  # the decode worker went away as it was sent
                continue
            outputs.append(out)
        if self._remote:
            outputs += self._remote_outputs(
                wait_s=0.0 if outputs or super().has_unfinished_requests() else IDLE_POLL_S
            )
        return outputs

    def _send_handoff(self, request_id: int, handoff, params: SamplingParams) -> bool:  # noqa: ANN001
        assert self.link is not None
        try:
            send_handoff(self.link, request_id, handoff, params)
            return True
        except OSError as e:
            self._drop_link(e)
            return False

    def _send(self, message: tuple) -> None:
        if self.link is not None:
            try:
                self.link.send(message)
            except OSError as e:
                self._drop_link(e)

    def _remote_outputs(self, wait_s: float) -> list[RequestOutput]:
        """What the decode worker sent back (errors for every in-flight request if it went away)."""
        outputs: list[RequestOutput] = []
        link = self.link
        try:
            while link is not None and link.poll(wait_s if not outputs else 0.0):
                kind, request_id, body = link.recv()
                if request_id not in self._remote:
                    continue  # aborted here meanwhile
                if kind == "refused":
                    out = replace(
                        self._remote.pop(request_id), finished=True, finish_reason="error", delta=""
                    )
                    outputs.append(replace(out, error=str(body)))
                    continue
                out = replace(body, request_id=request_id)
                outputs.append(out)
                if out.finished:
                    del self._remote[request_id]
        except (EOFError, OSError) as e:
            self._drop_link(e)
        if self.link is None:
            outputs += [self._lost(out) for out in self._remote.values()]
            self._remote.clear()
        return outputs

    def _lost(self, out: RequestOutput) -> RequestOutput:
        message = "the decode worker went away while this request was in flight; the request was stopped"
        return replace(out, finished=True, finish_reason="error", error=message, delta="")

    def _drop_link(self, error: BaseException) -> None:
        if self.link is not None:
            log.error(
                "the decode worker went away (%s); %d requests in flight fail, new ones decode here",
                error or type(error).__name__,
                len(self._remote),
            )
            self.link.close()
        self.link = None


def run_decode_worker(engine: PDEngine, socket_path: str) -> None:
    """Serve prefill workers at `socket_path`, one connection at a time, until interrupted."""
    path = Path(socket_path)
    if path.exists():
        path.unlink()
    old_umask = os.umask(0o077)  # the socket: this user only
    try:
        listener = Listener(str(path), family="AF_UNIX")
    finally:
        os.umask(old_umask)
    log.info("decode worker listening on %s", path)
    try:
        while True:
            conn = listener.accept()
            try:
                if _hello(engine, conn):
                    _serve_prefill_worker(engine, conn)
            finally:
                conn.close()
    finally:
        listener.close()


def _hello(engine: PDEngine, conn: Connection) -> bool:
    if not conn.poll(30.0):
        return False
    kind, identity, name = conn.recv()
    try:
        check_same_kv(identity, engine.kv_identity, name, str(engine.ckpt.root))
    except KvTransferError as e:
        log.error("%s", e)
        conn.send(("hello", str(e)))
        return False
    conn.send(("hello", None))
    log.info("prefill worker %s connected", name)
    return True


def _serve_prefill_worker(engine: PDEngine, conn: Connection) -> None:
    """Admit handoffs, send outputs back, until the prefill worker disconnects (its requests abort)."""
    live: dict[int, int] = {}  # local request id -> the prefill worker's
    try:
        while True:
            while conn.poll(0.0 if engine.has_unfinished_requests() else 1.0):
                _handle(engine, conn, conn.recv(), live)
            for out in engine.step():
                rid = live.get(out.request_id)
                if rid is not None:
                    conn.send(("out", rid, out))
                    if out.finished:
                        del live[out.request_id]
    except (EOFError, OSError):
        log.warning("the prefill worker disconnected; %d requests aborted", len(live))
        for request_id in live:
            engine.abort(request_id)


def _handle(engine: PDEngine, conn: Connection, message: tuple, live: dict[int, int]) -> None:
    kind, rid = message[0], message[1]
    if kind == "abort":
        for request_id, remote_id in list(live.items()):
            if remote_id == rid:
                engine.abort(request_id)
                del live[request_id]
        return
    assert kind == "handoff", kind
    meta, params, segment = message[2:]
    try:
        handoff = receive_handoff(meta, segment)
    except OSError as e:  # the segment is gone or unreadable: this request only
        log.error("request %d refused: its pages' shared memory %s: %s", rid, segment, e)
        conn.send(("refused", rid, f"the pages of this request could not be read from shared memory ({e})"))
        return
    try:
        live[engine.add_prefilled(handoff, params)] = rid
    except KvqError as e:
        log.error("request %d refused: %s", rid, e)
        conn.send(("refused", rid, str(e)))


def start_decode_worker(args: list[str], timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`kvq serve <args> --role decode` in a child process on a fresh private socket, once it listens
    (the one-command mode); a `KvqError` if it exits or does not listen within `timeout_s`."""
    socket_path = str(Path(tempfile.mkdtemp(prefix="kvq-pd-")) / "decode.sock")
    command = [sys.executable, "-m", "kvq", "serve", *args, "--role", "decode", "--pd-socket", socket_path]
    child = subprocess.Popen(command)
    deadline = time.monotonic() + timeout_s
    while not Path(socket_path).exists():
        if child.poll() is not None:
            raise KvqError(f"the decode worker exited with status {child.returncode} before listening")
        if time.monotonic() > deadline:
            child.kill()
            raise KvqError(f"the decode worker did not listen on {socket_path} within {timeout_s:.0f} s")
        time.sleep(0.1)
    return child, socket_path


def stop_child(child: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """End the one-command mode's decode worker (terminate, then kill)."""
    if child is None or child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def engine_flags(config: EngineConfig) -> list[str]:
    """`kvq serve` flags that make the decode worker's engine as `config` (but its own model)."""
    flags = [
        f"--dtype={config.dtype}",
        f"--kv-cache-dtype={config.kv_cache_dtype}",
        f"--page-size={config.page_size}",
        f"--max-num-seqs={config.max_num_seqs}",
        f"--kv-integrity={config.kv_integrity}",
        f"--lm-head-weights={config.lm_head_weights}",
    ]
    if config.kv_memory is not None:
        flags.append(f"--kv-memory={config.kv_memory}")
    if config.threads is not None:
        flags.append(f"--threads={config.threads}")
    if config.require_kv_scales:
        flags.append("--require-kv-scales")
    return flags
