"""Shared pytest fixtures: tiny checkpoints of each (arch, fmt), built once per session, and SmolLM2.

`tiny_checkpoint(arch, fmt)` returns the directory of a `checkpoint_fixtures.build_fixture` checkpoint
(built under the session's tmp dir on first request); `smollm2` builds the embedded model once into
`kvq.paths.cache_dir()` (`$KVQ_CACHE_DIR`, else the user cache) and returns its two directories.
"""

from __future__ import annotations

import os

# Triton decides at its first import whether @triton.jit functions are interpreted; the kernel tests run
# them on CPU tensors, so before anything imports triton (transformers and compressed-tensors do). A
# caller's own choice stands: scripts/gpu_check.sh sets 0 for compiled kernels on the GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvq.testing.checkpoint_fixtures import build_fixture  # noqa: E402
from kvq.testing.smollm2 import SmolLM2Paths, ensure_smollm2  # noqa: E402

TinyCheckpoint = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """`tiny_checkpoint(arch, fmt, *, seed=0, num_layers=None) -> Path`, each built once per session.

    Treat the directory as read-only: other tests share it.
    """
    built: dict[tuple, Path] = {}

    def get(arch: str, fmt: str, *, seed: int = 0, num_layers: int | None = None) -> Path:
        key = (arch, fmt, seed, num_layers)
        if key not in built:
            parent = tmp_path_factory.mktemp(f"{arch}-{fmt}-s{seed}-l{num_layers}")
            built[key] = build_fixture(arch, fmt, parent / "model", seed=seed, num_layers=num_layers)
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2Paths:
    """SmolLM2-135M-Instruct as BF16 and FP8-block checkpoints (first build about 20 s, then cached)."""
    return ensure_smollm2()
