"""The between-hosts transport of the prefill/decode split: torch.distributed point-to-point over gloo, in a
process group of its own (not the default group, not a tensor-parallel one).

The decode worker hosts a `TCPStore` at `--pd-addr HOST:PORT`; each prefill worker that joins takes the
next link number from the store and both sides build a two-rank `ProcessGroupGloo` on that store under
the link's prefix (decode rank 0, prefill rank 1), so one decode worker serves prefill workers one after
the other, as on the Unix socket. A message is any of `pd_link`'s tuples, pickled and sent as its length
then its bytes (uint8 tensors); a handoff's page bytes travel inside it (`pd_link.send_handoff` with a
link that `carries_pages`), the same records the shared-memory transport sends, verified on arrival by
the same `kv_transfer.verify_handoff`. `TorchLink` offers what the roles use of a `multiprocessing`
`Connection` (send, recv, poll, close; `EOFError` once the peer is gone or said goodbye). A peer that
never joins the group ends the other side's wait with an error after `JOIN_TIMEOUT`.
Imports torch and kvq.errors.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvq.errors import KvqError

JOIN_TIMEOUT = timedelta(seconds=300)  # a prefill worker reaching the store, both sides forming the group
LINK_TIMEOUT = timedelta(days=7)  # one message (an idle link waits between requests)
CLOSE_WAIT_S = 10.0  # for the peer's goodbye after ours
_BYE = 0  # a length of 0: the sender closed the link
_NEXT = "kvq-pd-links"  # store counter: links made so far


def parse_addr(addr: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port), or a `KvqError` naming --pd-addr."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvqError(f"--pd-addr is {addr!r}; give HOST:PORT, e.g. 10.0.0.2:29600")
    return host, int(port)


class TorchLink:
    """One prefill worker <-> decode worker link over a two-rank gloo group. A thread receives (gloo's
    receive completes only inside a blocking wait), so `poll` waits on a queue."""

    carries_pages = True  # handoffs carry their page bytes in the message (no shared memory)

    def __init__(self, group: Any, rank: int) -> None:  # noqa: ANN401  (a ProcessGroupGloo)
        self.group, self.peer = group, 1 - rank
        self._inbox: queue.Queue[tuple[bool, Any]] = queue.Queue()  # (is_end, message or why)
        self._next: tuple[bool, Any] | None = None  # polled, not yet received
        self.closed = False
        self._receiver = threading.Thread(target=self._receive, name="kvq-pd-link", daemon=True)
        self._receiver.start()
        atexit.register(self.close)  # a receive still blocked in gloo at exit would abort the process

    def send(self, message: object) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._send_bytes(len(data), torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether a message (or the end of the link) is here, waiting up to `timeout_s`."""
        if self._next is None:
            try:
                self._next = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
            except queue.Empty:
                return False
        return True

    def recv(self) -> Any:  # noqa: ANN401  (a pickled message, as Connection.recv)
        """The next message; `EOFError` once the peer closed the link or went away."""
        while not self.poll(1.0):
            pass
        assert self._next is not None
        is_end, body = self._next
        if is_end:
            self.closed = True
            raise EOFError(body)
        self._next = None
        return body

    def close(self) -> None:
        """Say goodbye (the peer's next receive ends with `EOFError`, and it says goodbye back) and wait a
        little for the peer's goodbye, which ends our receiving thread; once."""
        atexit.unregister(self.close)
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._send_bytes(_BYE, None)
        self._receiver.join(CLOSE_WAIT_S)

    def _receive(self) -> None:
        try:
            while True:
                length = torch.zeros(1, dtype=torch.int64)
                self.group.recv([length], self.peer, 0).wait()
                if int(length.item()) == _BYE:
                    self._inbox.put((True, "the peer closed the link"))
                    return
                data = torch.empty(int(length.item()), dtype=torch.uint8)
                self.group.recv([data], self.peer, 1).wait()
                self._inbox.put((False, pickle.loads(data.numpy().tobytes())))
        except RuntimeError as e:  # the peer's process is gone
            self._inbox.put((True, f"the peer went away: {e}"))

    def _send_bytes(self, length: int, data: torch.Tensor | None) -> None:
        try:
            self.group.send([torch.tensor([length], dtype=torch.int64)], self.peer, 0).wait()
            if data is not None:
                self.group.send([data], self.peer, 1).wait()
        except RuntimeError as e:  # the peer is gone: what a socket's send raises
            self.closed = True
            raise OSError(f"the peer went away: {e}") from e


def _group(store: dist.Store, link: int, rank: int) -> Any:  # noqa: ANN401  (a ProcessGroupGloo)
    prefixed = dist.PrefixStore(f"kvq-pd-link-{link}/", store)
    return dist.ProcessGroupGloo(prefixed, rank, 2, LINK_TIMEOUT)


class TorchListener:
    """The decode worker's end: a store at `addr` that prefill workers join, one link each."""

    def __init__(self, addr: str) -> None:
        host, port = parse_addr(addr)
        try:
            self.store = dist.TCPStore(
                host, port, is_master=True, timeout=JOIN_TIMEOUT, wait_for_workers=False
            )
        except (RuntimeError, OSError) as e:
            raise KvqError(
                f"--pd-addr {addr}: cannot listen there ({e}); pick a free port on this host"
            ) from e
        self.store.set(_NEXT, "0")
        self.accepted = 0

    def accept(self) -> TorchLink:
        """The next prefill worker's link (waits for it to join)."""
        self.accepted += 1
        while int(self.store.get(_NEXT)) < self.accepted:
            time.sleep(0.05)
        return TorchLink(_group(self.store, self.accepted, 0), 0)

    def close(self) -> None:
        pass  # the store lives as long as the process


def connect_torch(addr: str) -> TorchLink:
    """A link to the decode worker listening at `addr` (the hello is `pd_link.hello`'s)."""
    host, port = parse_addr(addr)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=JOIN_TIMEOUT)
        link = int(store.add(_NEXT, 1))
        return TorchLink(_group(store, link, 1), 1)
    except (RuntimeError, OSError) as e:
        raise KvqError(
            f"--pd-addr {addr}: no decode worker answers there ({e}); start `kvq serve MODEL --role decode "
            f"--pd-transport torch --pd-addr {addr}` first"
        ) from e
