"""Fixtures of the real-client tests: the embedded SmolLM2 served by `kvq serve`'s app on loopback, and no
network for the clients (lm-eval, datasets and GuideLLM read only local files)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.serve.conftest import Running, running_server

# Read when datasets / huggingface_hub are imported: before any client module is.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def fp32_engine(smollm2) -> Engine:
    """SmolLM2 (BF16 checkpoint) in fp32 reference mode: the engine whose scores equal transformers' fp32."""
    return Engine(EngineConfig(model=str(smollm2.bf16), dtype="float32", kv_memory="64MiB", threads=2))


@pytest.fixture(scope="module")
def fp32_server(fp32_engine: Engine) -> Iterator[Running]:
    with running_server(fp32_engine) as running:
        yield running
