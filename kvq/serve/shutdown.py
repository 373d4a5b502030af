"""Graceful shutdown: on SIGTERM (or Ctrl-C) stop accepting, let running requests finish for
`--shutdown-timeout` seconds, then end the rest with an error (an error event when streaming), and exit 0.

uvicorn already stops listening and waits for open connections; `DrainingServer` adds the drain state
(new API requests get 503), the deadline that ends what still runs (`AsyncEngine.abort_all`), and it does
not re-raise the signal afterwards (uvicorn's default), so a drained server exits with status 0. A second
Ctrl-C still forces the exit. Imports uvicorn and kvq.serve.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from kvq.serve.access import ServeState
from kvq.serve.async_engine import AsyncEngine

log = logging.getLogger("kvq.serve")
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
BACKSTOP_SECONDS = 5.0  # after the deadline, for the aborted requests' last events to go out


class DrainingServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, engine: AsyncEngine, state: ServeState, timeout: float
    ) -> None:
        config.timeout_graceful_shutdown = int(timeout + BACKSTOP_SECONDS) + 1  # then uvicorn cancels all
        super().__init__(config)
        self.engine, self.state, self.timeout = engine, state, timeout
        self._deadline: threading.Timer | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._deadline is not None:
                self._deadline.cancel()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self.drain()

    def drain(self) -> None:
        """Stop taking requests; end those still running after `timeout` seconds. Idempotent."""
        if self.state.is_draining:
            return
        self.state.is_draining = True
        log.warning(
            "kvq serve: shutting down; running requests get %.0f s to finish (--shutdown-timeout)",
            self.timeout,
        )
        self._deadline = threading.Timer(self.timeout, self._end_the_rest)
        self._deadline.daemon = True
        self._deadline.start()

    def drain_now(self) -> None:
        """The engine stopped: take no more requests and exit (from any thread)."""
        self.state.is_draining = True
        self.should_exit = True

    def _end_the_rest(self) -> None:
        self.engine.abort_all(f"the server shut down and the {self.timeout:.0f} s shutdown timeout passed")
