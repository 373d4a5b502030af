"""One engine, many HTTP requests: the engine steps on its own thread; asyncio handlers submit requests
and await their outputs.

Requests arriving while others run join the next scheduler step (continuous batching across clients).
All engine and tokenizer work happens on the engine thread; handlers only exchange messages with it
(a locked inbox one way, `loop.call_soon_threadsafe` the other). A handler that stops listening (its
client went away) aborts its request, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvq.errors import KvqError
from kvq.runtime.engine import Engine, RequestOutput
from kvq.runtime.sampling import SamplingParams

log = logging.getLogger("kvq.serve")

# What a request sends: the engine turns it into token ids on its thread (tokenizers are not shared).
Encode = Callable[[Engine], list[int]]


@dataclass
class _Request:
    encode: Encode
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    request_id: int | None = None
    is_abandoned: bool = False

    def send(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """`async for out in engine.generate(encode, params)`: outputs of one request as steps produce them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[_Request] = []
        self._abandoned: list[_Request] = []
        self._calls: list[tuple[Callable[[Engine], Any], Future]] = []
        self._is_stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvq-engine", daemon=True)
        self._thread.start()

    async def generate(self, encode: Encode, params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request until it finishes; a `KvqError` if the engine refuses it (prompt too long
        for the context or the KV pool, ...). Stopping the iteration early aborts the request."""
        request = _Request(encode, params, asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            self._inbox.append(request)
            self._wake.notify()
        finished = False
        try:
            while not finished:
                item = await request.queue.get()
                if isinstance(item, BaseException):
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

    def stop(self) -> None:
        with self._wake:
            self._is_stopping = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        live: dict[int, _Request] = {}
        while True:
            with self._wake:
                while not (self._inbox or self._abandoned or self._calls or self._is_stopping or live):
                    self._wake.wait()
                if self._is_stopping:
                    return
                inbox, self._inbox = self._inbox, []
                abandoned, self._abandoned = self._abandoned, []
                calls, self._calls = self._calls, []
            for fn, future in calls:
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            for request in abandoned:
                request.is_abandoned = True
                if request.request_id is not None and live.pop(request.request_id, None) is not None:
                    self.engine.abort(request.request_id)
            for request in inbox:
                if request.is_abandoned:
                    continue
                try:
                    request.request_id = self.engine.add_request(request.encode(self.engine), request.params)
                    live[request.request_id] = request
                except KvqError as e:
                    request.send(e)
            if not live:
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a bug, not a bad request: fail what is running, keep serving
                log.exception("engine step failed")
                for request_id, request in live.items():
                    self.engine.abort(request_id)
                    request.send(RuntimeError(f"the engine failed: {e}"))
                live.clear()
                continue
            for out in outputs:
                owner = live.get(out.request_id)
                if owner is None:
                    continue
                owner.send(out)
                if out.finished:
                    del live[out.request_id]
