"""A real `kvq serve` app on loopback: uvicorn in a thread over a given engine, torn down after use."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import uvicorn

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.serve.access import ServeState
from kvq.serve.app import Served, make_app
from kvq.serve.async_engine import AsyncEngine
from kvq.serve.encoder import PromptEncoder
from kvq.serve.metrics import ServeMetrics
from kvq.serve.server_config import ServerConfig


@dataclass
class Running:
    url: str
    engine: Engine
    async_engine: AsyncEngine
    served: Served


@pytest.fixture(scope="session")
def smollm2_engine(smollm2) -> Engine:
    """The embedded SmolLM2 in fp32 reference mode (greedy tokens do not depend on the batch), shared by
    the serve tests: one server at a time drives it."""
    return Engine(EngineConfig(model=str(smollm2.bf16), dtype="float32", kv_memory="64MiB", threads=2))


@contextmanager
def running_server(engine: Engine, model_name: str = "smollm2", **server: object) -> Iterator[Running]:
    """`engine` behind a fresh app (its own metrics registry) on a free loopback port."""
    config = ServerConfig(port=0, log_level="warning", **server)  # type: ignore[arg-type]
    metrics = ServeMetrics()
    async_engine = AsyncEngine(engine, metrics)
    served = Served(async_engine, PromptEncoder(engine.ckpt.root), model_name, config, metrics, ServeState())
    uv = uvicorn.Server(uvicorn.Config(make_app(served), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield Running(f"http://127.0.0.1:{port}", engine, async_engine, served)
    finally:
        uv.should_exit = True
        thread.join(timeout=30)
        async_engine.stop()
        served.encoder.close()
