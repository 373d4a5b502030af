"""Compress-suite fixtures: kvq's and llm-compressor's outputs of the tiny fixtures, built once a session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run

Compressed = Callable[..., Path]
FIXTURES = [(arch, fmt) for arch in ("llama", "glm4_moe", "glm_moe_dsa") for fmt in ("fp8-block", "bf16")]


def compress(
    src: Path,
    out: Path,
    recipe: str = "w4a16-experts",
    group_size: int | None = None,
    workers: int = 2,
    target: str = "vllm",
) -> Path:
    run(prepare(src, out, load_recipe(recipe, group_size), target), workers)
    return out


def kept_modules(src: Path, recipe: str, group_size: int | None) -> tuple[str, ...]:
    """Modules kvq keeps at source precision because the group size does not divide their in_features."""
    from kvq.checkpoint.reader import Checkpoint, block_size
    from kvq.compress.tensor_plan import build_plan

    ckpt = Checkpoint.open(src)
    plan = build_plan(ckpt.tensors, load_recipe(recipe, group_size), block_size(ckpt))
    return tuple(k.name.removesuffix(".weight") for k in plan.kept)


@pytest.fixture(scope="session")
def compressed(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Compressed:
    """`compressed(arch, fmt, recipe="w4a16-experts", group_size=None, target="vllm") -> Path`: kvq's
    output, built once."""
    built: dict[tuple, Path] = {}

    def get(
        arch: str,
        fmt: str,
        recipe: str = "w4a16-experts",
        group_size: int | None = None,
        target: str = "vllm",
    ) -> Path:
        key = (arch, fmt, recipe, group_size, target)
        if key not in built:
            out = tmp_path_factory.mktemp(f"kvq-{arch}-{fmt}-{recipe}-g{group_size}-{target}") / "out"
            built[key] = compress(tiny_checkpoint(arch, fmt), out, recipe, group_size, target=target)
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

            src = tiny_checkpoint(arch, fmt)
            out = tmp_path_factory.mktemp(f"mfp-{arch}-{fmt}-{recipe}-g{group_size}") / "out"
            run_model_free_ptq(
                str(src), str(out), recipe, 1, group_size, kept_modules(src, recipe, group_size)
            )
            built[key] = out
        return built[key]

    return get
