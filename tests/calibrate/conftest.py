"""Fixtures for calibration tests: INT4 (pack-quantized) twins of the tiny fixtures, small text files."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import TinyCheckpoint

# Linear layers whose input width is not a multiple of 128 (tiny fixtures) stay BF16, like kvq compress.
W4A16_IGNORE = [
    "lm_head",
    "re:.*embed_tokens$",
    "re:.*mlp\\.gate$",
    "re:.*indexer\\.weights_proj$",
    "re:.*q_b_proj$",
    "re:.*indexer\\.wq_b$",
    "re:.*mlp\\.down_proj$",
]


@pytest.fixture(scope="session")
def int4_checkpoint(
    tiny_checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """`int4_checkpoint(arch)`: the tiny BF16 fixture as compressed-tensors pack-quantized W4A16 (read-only).

    Built with llm-compressor's `model_free_ptq`, whose output format is the one `kvq compress` writes.
    """
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            from llmcompressor import model_free_ptq

            out = tmp_path_factory.mktemp(f"{arch}-w4a16") / "model"
            model_free_ptq(tiny_checkpoint(arch, "bf16"), out, scheme="W4A16", ignore=W4A16_IGNORE)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="session")
def kvq_compressed(
    tiny_checkpoint: TinyCheckpoint,
    int4_checkpoint: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], Path]:
    """`kvq_compressed(arch)`: the tiny FP8-block fixture through `kvq compress` (recipe w4a16-experts),
    or, where kvq compress is not in this checkout, the llm-compressor twin of `int4_checkpoint`."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if importlib.util.find_spec("kvq.compress") is None:
            return int4_checkpoint(arch)
        if arch not in built:
            out = tmp_path_factory.mktemp(f"{arch}-kvq-int4") / "model"
            argv = [
                sys.executable,
                "-m",
                "kvq",
                "compress",
                str(tiny_checkpoint(arch, "fp8-block")),
                str(out),
                "--recipe",
                "w4a16-experts",
                "--workers",
                "1",
                "--quiet",
            ]
            subprocess.run(argv, check=True, capture_output=True, timeout=600)
            built[arch] = out
        return built[arch]

    return get


@pytest.fixture(scope="session")
def int4_by(
    kvq_compressed: Callable[[str], Path], int4_checkpoint: Callable[[str], Path]
) -> Callable[[str, str], Path]:
    """`int4_by(producer, arch)`: `kvq_compressed(arch)` for producer "kvq compress", else (`model_free_ptq`)
    `int4_checkpoint(arch)`."""

    def get(producer: str, arch: str) -> Path:
        return kvq_compressed(arch) if producer == "kvq compress" else int4_checkpoint(arch)

    return get


def writable(src: Path, tmp_path: Path) -> Path:
    """A private copy of a shared (read-only) fixture checkpoint."""
    return Path(shutil.copytree(src, tmp_path / src.parent.name))


@pytest.fixture
def small_dataset(tmp_path: Path) -> Path:
    """A .jsonl file with a few real Wikipedia paragraphs (enough for 4 samples of 64 tokens)."""
    import json

    from kvq.data.texts import load_texts

    texts = load_texts(None, "calibration")[:3]
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t[:3000]}) + "\n" for t in texts))
    return path
