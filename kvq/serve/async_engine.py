"""One engine, many HTTP requests: the engine steps on its own thread; asyncio handlers submit requests
and await their outputs.

Requests arriving while others run join the next scheduler step (continuous batching across clients).
All engine work happens on the engine thread; handlers only exchange messages with it (a locked inbox
one way, `loop.call_soon_threadsafe` the other). A handler that stops listening (its client went away)
aborts its request, which frees its KV pages. `num_waiting` (submitted, no output yet) is what
back-pressure bounds; `abort_all` ends every request with `ServerShuttingDown` (graceful shutdown).
Should the engine thread itself stop (an error outside any one request's step), that is said once in the
log, every request in flight and every later one ends with `EngineDead` (a 503), `dead_reason` says why
(`/health` answers 503) and `on_death` is called (`kvq serve` then exits non-zero, as vLLM does, so a
supervisor restarts it). Imports kvq.runtime and kvq.serve.metrics.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvq.errors import KvqError
from kvq.runtime.engine import Engine
from kvq.runtime.outputs import RequestOutput
from kvq.runtime.sampling import SamplingParams
from kvq.serve.metrics import RequestTimes, ServeMetrics

log = logging.getLogger("kvq.serve")


class ServerShuttingDown(Exception):
    """The server stopped this request: it was still running when the shutdown timeout passed."""


class EngineDead(ServerShuttingDown):
    """The engine thread has stopped: no request can run on this server any more."""


@dataclass(eq=False)
class _Request:
    token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    times: RequestTimes = field(default_factory=RequestTimes)
    request_id: int | None = None
    is_waiting: bool = True  # submitted, no output yet
    is_abandoned: bool = False

    def send(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """`async for out in engine.generate(token_ids, params)`: outputs of one request as steps produce them."""

    def __init__(
        self, engine: Engine, metrics: ServeMetrics | None = None, on_death: Callable[[], None] | None = None
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_death = on_death
        self.dead_reason: str | None = None  # why the engine thread stopped (None: it runs)
        self.num_waiting = 0  # requests submitted that have no output yet (queued or being prefilled)
        self.num_running = 0  # requests with outputs, not finished
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Request] = []
        self._abandoned: list[_Request] = []
        self._calls: list[tuple[Callable[[Engine], Any], Future]] = []
        self._shutdown_reason: str | None = None
        self._is_stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvq-engine", daemon=True)
        self._thread.start()

    def generate(self, token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue one request now (it counts in `num_waiting` from here) and return its outputs until it
        finishes; they raise `KvqError` if the engine refuses it (prompt too long for the KV pool, ...).
        Closing the iterator early aborts the request. Call on the event loop."""
        request = _Request(token_ids, params, asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if self.dead_reason is not None:
                request.queue.put_nowait(EngineDead(f"the engine stopped: {self.dead_reason}"))
                return self._outputs(request)
            self._inbox.append(request)
            self.num_waiting += 1
            self._wake.notify()
        return self._outputs(request)

    async def _outputs(self, request: _Request) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await request.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                with self._wake:
                    self._abandoned.append(request)
                    self._wake.notify()

    def call(self, fn: Callable[[Engine], Any]) -> Future:
        """Run `fn(engine)` on the engine thread between two steps (the only thread that may touch the
        engine's state); its result or exception comes in the returned future. From any thread."""
        future: Future = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def abort_all(self, reason: str) -> None:
        """End every request, queued or running, with `ServerShuttingDown(reason)`. From any thread."""
        with self._wake:
            self._shutdown_reason = reason
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._is_stopping = True
            self._wake.notify()
        self._thread.join()

    def _leave_waiting(self, request: _Request) -> None:
        if request.is_waiting:
            request.is_waiting = False
            with self._lock:
                self.num_waiting -= 1

    def _loop(self) -> None:
        live: dict[int, _Request] = {}
        try:
            self._serve(live)
        except BaseException as e:  # the thread ends: say so once, end every request, tell the server
            log.critical("the engine thread stopped: %s: %s", type(e).__name__, e, exc_info=e)
            with self._wake:
                self.dead_reason = f"{type(e).__name__}: {e}"
                waiting, self._inbox = self._inbox, []
            error = EngineDead(f"the engine stopped: {self.dead_reason}")
            for request in [*live.values(), *waiting]:
                request.send(error)
            if self.on_death is not None:
                self.on_death()

    def _serve(self, live: dict[int, _Request]) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._abandoned or self._calls or self._is_stopping or live) and (
                    self._shutdown_reason is None
                ):
                    self._wake.wait()
                if self._is_stopping:
                    return
                inbox, self._inbox = self._inbox, []
                abandoned, self._abandoned = self._abandoned, []
                calls, self._calls = self._calls, []
                shutdown, self._shutdown_reason = self._shutdown_reason, None
            for fn, future in calls:
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            for request in abandoned:
                request.is_abandoned = True
                if request.request_id is not None and live.pop(request.request_id, None) is not None:
                    self.engine.abort(request.request_id)
                    self._finished(request, "abort")
                self._leave_waiting(request)
            self._admit(inbox, live)
            if shutdown is not None:
                self._fail_all(live, ServerShuttingDown(shutdown))
            if live:
                self._step(live)

    def _admit(self, inbox: list[_Request], live: dict[int, _Request]) -> None:
        for request in inbox:
            if request.is_abandoned:
                continue
            try:
                request.request_id = self.engine.add_request(request.token_ids, request.params)
                live[request.request_id] = request
            except KvqError as e:
                self._leave_waiting(request)
                request.send(e)
            except Exception as e:  # a bug in admitting this one request: it alone fails
                log.exception("admitting a request failed")
                self._leave_waiting(request)
                request.send(RuntimeError(f"the engine could not take the request: {e}"))

    def _step(self, live: dict[int, _Request]) -> None:
        start = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:  # a bug, not a bad request: fail what is running, keep serving
            log.exception("engine step failed")
            self._fail_all(live, RuntimeError(f"the engine failed: {e}"))
            return
        now = time.monotonic()
        for out in outputs:
            owner = live.get(out.request_id)
            if owner is None:
                continue
            if self.metrics is not None:
                self.metrics.on_output(owner.times, out, start, now)
            if owner.is_waiting:
                self._leave_waiting(owner)
                self.num_running += 1
            owner.send(out)
            if out.finished:
                del live[out.request_id]
                self._finished(owner, out.finish_reason)
        if self.metrics is not None:
            self.metrics.on_step(self.engine)

    def _finished(self, request: _Request, reason: str | None) -> None:
        """A live request ended (or was ended): out of the running (or waiting) count, into the metrics."""
        if request.is_waiting:
            self._leave_waiting(request)
        else:
            self.num_running -= 1
        if self.metrics is not None:
            self.metrics.on_finished(request.times, reason or "abort", time.monotonic())

    def _fail_all(self, live: dict[int, _Request], error: BaseException) -> None:
        for request_id, request in live.items():
            self.engine.abort(request_id)
            self._finished(request, "abort")
            request.send(error)
        live.clear()
