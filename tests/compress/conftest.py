"""Compress-suite helpers: run kvq compress (or build its command line), and the modules kvq keeps (what
model_free_ptq must leave alone).

The session fixtures `compressed` and `model_free` that use them live in tests/conftest.py (tests/check
uses them too)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run

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


def compress_argv(src: Path, out: Path, recipe: str, *args: str) -> list[str]:
    """`python -m kvq compress SRC OUT --recipe RECIPE ARGS...`, to run in a subprocess."""
    return [sys.executable, "-m", "kvq", "compress", str(src), str(out), "--recipe", recipe, *args]


def kept_modules(src: Path, recipe: str, group_size: int | None) -> tuple[str, ...]:
    """Modules kvq keeps at source precision because the group size does not divide their in_features."""
    from kvq.checkpoint.reader import Checkpoint, block_size
    from kvq.compress.tensor_plan import build_plan

    ckpt = Checkpoint.open(src)
    plan = build_plan(ckpt.tensors, load_recipe(recipe, group_size), block_size(ckpt))
    return tuple(k.name.removesuffix(".weight") for k in plan.kept)
