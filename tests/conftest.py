"""Shared pytest fixtures: tiny checkpoints of each (arch, fmt), built once per session, and SmolLM2.

`tiny_checkpoint(arch, fmt)` returns the directory of a `checkpoint_fixtures.build_fixture` checkpoint
(built under the session's tmp dir on first request); `compressed` / `model_free` kvq's and llm-compressor
model_free_ptq's outputs of them; `smollm2` builds the embedded model once into
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

from kvq.data.embedded_model import SmolLM2Paths, ensure_smollm2  # noqa: E402
from kvq.fixtures.checkpoint_fixtures import build_fixture  # noqa: E402

TinyCheckpoint = Callable[..., Path]
Compressed = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """`tiny_checkpoint(arch, fmt, *, seed=0, num_layers=None, vocab_size=None, num_mtp_layers=0) -> Path`,
    each built once per session; `vocab_size` pads the embedding past the tokenizer's 2000 tokens, as real
    checkpoints do; `num_mtp_layers` (glm_moe_dsa, deepseek_v3) appends MTP / NextN layers.

    Treat the directory as read-only: other tests share it.
    """
    built: dict[tuple, Path] = {}

    def get(
        arch: str,
        fmt: str,
        *,
        seed: int = 0,
        num_layers: int | None = None,
        vocab_size: int | None = None,
        num_mtp_layers: int = 0,
    ) -> Path:
        key = (arch, fmt, seed, num_layers, vocab_size, num_mtp_layers)
        if key not in built:
            name = f"{arch}-{fmt}-s{seed}-l{num_layers}-v{vocab_size}-mtp{num_mtp_layers}"
            built[key] = build_fixture(
                arch,
                fmt,
                tmp_path_factory.mktemp(name) / "model",
                seed=seed,
                num_layers=num_layers,
                vocab_size=vocab_size,
                num_mtp_layers=num_mtp_layers,
            )
        return built[key]

    return get


@pytest.fixture(scope="session")
def smollm2() -> SmolLM2Paths:
    """SmolLM2-135M-Instruct as BF16 and FP8-block checkpoints (first build about 20 s, then cached)."""
    return ensure_smollm2()


@pytest.fixture(scope="session")
def compressed(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Compressed:
    """`compressed(arch, fmt, recipe="w4a16-experts", group_size=None, target="vllm", num_mtp_layers=0)
    -> Path`: kvq's output of `tiny_checkpoint(arch, fmt, num_mtp_layers=...)`, built once."""
    built: dict[tuple, Path] = {}

    def get(
        arch: str,
        fmt: str,
        recipe: str = "w4a16-experts",
        group_size: int | None = None,
        target: str = "vllm",
        num_mtp_layers: int = 0,
    ) -> Path:
        key = (arch, fmt, recipe, group_size, target, num_mtp_layers)
        if key not in built:
            name = f"kvq-{arch}-{fmt}-{recipe}-g{group_size}-{target}-mtp{num_mtp_layers}"
            from tests.compress.conftest import compress

            src = tiny_checkpoint(arch, fmt, num_mtp_layers=num_mtp_layers)
            out = tmp_path_factory.mktemp(name) / "out"
            built[key] = compress(src, out, recipe, group_size, target=target)
        return built[key]

    return get


@pytest.fixture(scope="session")
def model_free(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Compressed:
    """`model_free(arch, fmt, recipe, group_size) -> Path`: llm-compressor model_free_ptq's output."""
    built: dict[tuple, Path] = {}

    def get(arch: str, fmt: str, recipe: str = "w4a16-experts", group_size: int | None = None) -> Path:
        key = (arch, fmt, recipe, group_size)
        if key not in built:
            from kvq.bench.compress import run_model_free_ptq
            from tests.compress.conftest import kept_modules

            src = tiny_checkpoint(arch, fmt)
            out = tmp_path_factory.mktemp(f"mfp-{arch}-{fmt}-{recipe}-g{group_size}") / "out"
            run_model_free_ptq(
                str(src), str(out), recipe, 1, group_size, kept_modules(src, recipe, group_size)
            )
            built[key] = out
        return built[key]

    return get
