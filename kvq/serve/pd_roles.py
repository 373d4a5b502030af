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
from multiprocessing.connection import Listener
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.runtime.config import ENGINE_OPTIONS, EngineConfig
from kvq.runtime.kv_transfer import KVHandoff, KvTransferError, check_same_kv
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.pd_engine import PDEngine, failed_output
from kvq.runtime.request import Request
from kvq.runtime.sampling import SamplingParams
from kvq.serve.pd_link import Link, connect, hello, receive_handoff, send_handoff
from kvq.serve.pd_torch import TorchListener, connect_torch, parse_addr

log = logging.getLogger("kvq.serve")
IDLE_POLL_S = 0.005  # how long a step with only remote requests waits for the decode worker's outputs


class PrefillFront(PDEngine):
    def __init__(self, config: EngineConfig, socket_path: str | None, pd_addr: str | None = None) -> None:
        """Hand off to the decode worker on the Unix socket `socket_path`, or over torch.distributed at
        `pd_addr` (HOST:PORT, `pd_torch`); neither: decode here."""
        super().__init__(config)
        self.link: Link | None = None
        if socket_path is not None:
            self.link = connect(socket_path, self.kv_identity, str(self.ckpt.root))
        elif pd_addr is not None:
            link = connect_torch(pd_addr)
            self.link = hello(link, self.kv_identity, str(self.ckpt.root), f"--pd-addr {pd_addr}")
        self._params: dict[int, SamplingParams] = {}  # queued to hand off
        self._remote: dict[int, list[int]] = {}  # handed off: request id -> its prompt
        self.num_handoffs = 0
        self.handoff_bytes = 0

    def queue(self, seq: Request) -> None:
        super().queue(seq)
        if self.link is not None:
            self.mark_for_hand_off(seq.seq_id)
            self._params[seq.seq_id] = seq.params

    def abort(self, request_id: int) -> bool:
        if self._remote.pop(request_id, None) is not None:
            self._send(("abort", request_id))
            return True
        self._params.pop(request_id, None)
        return super().abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._remote) or super().has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for request_id, handoff in self.take_handoffs().items():
            params = self._params.pop(request_id)
            if self._send_handoff(request_id, handoff, params):
                self._remote[request_id] = handoff.prompt_token_ids
                self.num_handoffs += 1
                self.handoff_bytes += handoff.num_bytes
            else:
                outputs.append(self._lost(request_id, handoff.prompt_token_ids))
        if self._remote:
            is_idle = not outputs and not super().has_unfinished_requests()
            outputs += self._remote_outputs(IDLE_POLL_S if is_idle else 0.0)
        return outputs

    def _send_handoff(self, request_id: int, handoff: KVHandoff, params: SamplingParams) -> bool:
        if self.link is None:
            return False
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
                    outputs.append(failed_output(request_id, self._remote.pop(request_id), str(body)))
                    continue
                out = replace(body, request_id=request_id)
                outputs.append(out)
                if out.finished:
                    del self._remote[request_id]
        except (EOFError, OSError) as e:
            self._drop_link(e)
        if self.link is None:
            outputs += [self._lost(request_id, prompt) for request_id, prompt in self._remote.items()]
            self._remote.clear()
        return outputs

    def _lost(self, request_id: int, prompt: list[int]) -> RequestOutput:
        message = "the decode worker went away while this request was in flight; the request was stopped"
        return failed_output(request_id, prompt, message)

    def _drop_link(self, error: BaseException) -> None:
        """No decode worker any more: requests not yet prefilled decode here from now on."""
        if self.link is not None:
            log.error(
                "the decode worker went away (%s); %d requests in flight fail, new ones decode here",
                error or type(error).__name__,
                len(self._remote),
            )
            self.link.close()
        self.link = None
        self._to_hand_off.clear()
        self._params.clear()


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
    serve_links(engine, listener)


def run_torch_decode_worker(engine: PDEngine, pd_addr: str) -> None:
    """Serve prefill workers joining over torch.distributed at `pd_addr` (`pd_torch`), as on a socket."""
    listener = TorchListener(pd_addr)
    log.info("decode worker listening on %s (torch.distributed, gloo)", pd_addr)
    serve_links(engine, listener)


def serve_links(engine: PDEngine, listener: Listener | TorchListener) -> None:
    """One prefill worker's link at a time, from `listener`, until interrupted."""
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


def _hello(engine: PDEngine, conn: Link) -> bool:
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


def _serve_prefill_worker(engine: PDEngine, conn: Link) -> None:
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


def _handle(engine: PDEngine, conn: Link, message: tuple, live: dict[int, int]) -> None:
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
        where = "the message" if isinstance(segment, torch.Tensor) else f"shared memory {segment}"
        log.error("request %d refused: its pages in %s: %s", rid, where, e)
        conn.send(("refused", rid, f"the pages of this request could not be read from {where} ({e})"))
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
    try:
        while not Path(socket_path).exists():
            if child.poll() is not None:
                raise KvqError(f"the decode worker exited with status {child.returncode} before listening")
            if time.monotonic() > deadline:
                raise KvqError(f"the decode worker did not listen on {socket_path} within {timeout_s:.0f} s")
            time.sleep(0.1)
    except BaseException:  # Ctrl-C while it loads, too: no orphan worker
        stop_child(child)
        raise
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
    """`kvq serve` flags that make the decode worker's engine as `config` (but its own model): every engine
    option that is set (a flag that is off, or a value that is None, is left to its default)."""
    flags = []
    for name in ENGINE_OPTIONS:
        value = getattr(config, name)
        if value is True:
            flags.append("--" + name.replace("_", "-"))
        elif value is not None and value is not False:
            flags.append(f"--{name.replace('_', '-')}={value}")
    return flags


def check_transport(role: str, transport: str, socket_path: str | None, pd_addr: str | None) -> None:
    """`kvq serve`'s --pd-transport, --pd-socket and --pd-addr for `role` (a `KvqError` naming the fix)."""
    if transport not in ("shm", "torch"):
        raise KvqError(f"--pd-transport is {transport!r}; pick shm or torch")
    if role == "pd" and transport == "torch":
        raise KvqError(
            "--role pd runs both workers on this host over shared memory; drop --pd-transport torch"
        )
    if role not in ("prefill", "decode"):
        return
    if transport == "shm" and socket_path is None:
        raise KvqError(f"--role {role} needs --pd-socket PATH (the decode worker's Unix socket)")
    if transport == "torch":
        if pd_addr is None:
            raise KvqError(
                f"--role {role} --pd-transport torch needs --pd-addr HOST:PORT (the decode worker's)"
            )
        parse_addr(pd_addr)
