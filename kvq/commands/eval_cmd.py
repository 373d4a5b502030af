"""`kvq eval MODEL [--baseline BASE]`: perplexity through the runtime that serves the model, vs a baseline.

Every prediction is made by a decode step of the kvq engine (packed INT4 weights, paged KV in the
checkpoint's dtype, FP8 with its calibrated scales), the way `kvq serve` answers: windows of held-out
text are scored by teacher forcing (`Engine.perplexity`). The text is the bundled Wikipedia articles'
held-out split (never used by `kvq calibrate`) unless `--text` names another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvq.commands.engine_options import (
    DtypeOption,
    KvCacheDtypeOption,
    KvMemoryOption,
    LmHeadWeightsOption,
    ModelArgument,
    ThreadsOption,
    TpOption,
)
from kvq.commands.render import console
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig


def eval_command(
    model: ModelArgument,
    baseline: Annotated[
        Path | None,
        typer.Option(help="A checkpoint to compare with (e.g. the source of MODEL); same tokenizer."),
    ] = None,
    num_windows: Annotated[int, typer.Option(help="Text windows scored (all decoded together).")] = 16,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 256,
    text: Annotated[
        Path | None,
        typer.Option(
            help="Evaluation text: .txt (documents separated by blank lines) or .jsonl (a 'text' field per "
            "line). Default: the bundled Wikipedia articles' held-out split."
        ),
    ] = None,
    kv_cache_dtype: KvCacheDtypeOption = EngineConfig.kv_cache_dtype,
    kv_memory: KvMemoryOption = None,
    dtype: DtypeOption = EngineConfig.dtype,
    threads: ThreadsOption = None,
    tp: TpOption = EngineConfig.tp,
    lm_head_weights: LmHeadWeightsOption = EngineConfig.lm_head_weights,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON.")] = None,
) -> None:
    """Perplexity of MODEL (and of --baseline) on held-out text, computed by the kvq runtime itself."""
    from kvq.calibrate.samples import build_samples
    from kvq.data.texts import DEFAULT_SOURCE, load_texts, source_name
    from kvq.runtime.engine import Engine

    if seq_len < 2 or num_windows < 1:
        raise KvqError(f"--seq-len must be >= 2 and --num-windows >= 1 (got {seq_len}, {num_windows})")
    source = DEFAULT_SOURCE + " (held out)" if text is None else source_name(text)
    texts = load_texts(text, "held_out" if text is None else "all")
    rows: list[dict[str, Any]] = []
    windows: list[list[int]] | None = None
    for path in [model, *([baseline] if baseline is not None else [])]:
        config = EngineConfig(
            model=str(path),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_memory=kv_memory,
            threads=threads,
            tp=tp,
            lm_head_weights=lm_head_weights,
            max_num_seqs=num_windows,
        )
        engine = Engine(config)
        samples = build_samples(
            texts, engine.tokenizer, num_samples=num_windows, seq_len=seq_len, seed=0, source=source
        )
        if windows is None:
            windows = samples.input_ids.tolist()
        elif samples.input_ids.tolist() != windows:
            raise KvqError(
                f"{path}: its tokenizer splits the text differently from {model}'s; compare checkpoints "
                "of the same model (e.g. a compressed one and its source)"
            )
        rows.append(
            {
                "model": str(path),
                "format": engine.ckpt.format,
                "kv_cache": str(engine.kv_pool.dtype).removeprefix("torch."),
                "perplexity": engine.perplexity(windows),
            }
        )
        engine.close()  # its tensor-parallel ranks too, before the baseline's start
        del engine
    assert windows is not None
    if baseline is not None:
        rows[0]["vs_baseline"] = rows[0]["perplexity"] / rows[1]["perplexity"] - 1
    console.print(_table(rows, source, num_windows, seq_len))
    if json_out is not None:
        report = {"text": source, "num_windows": num_windows, "seq_len": seq_len, "rows": rows}
        json_out.write_text(json.dumps(report, indent=2) + "\n")


def _table(rows: list[dict], source: str, num_windows: int, seq_len: int) -> Table:
    table = Table(title=f"kvq eval: perplexity on {num_windows} x {seq_len} tokens of {source}")
    for column in ("model", "weights", "KV cache", "perplexity", "vs baseline"):
        table.add_column(column, justify="left" if column in ("model", "weights", "KV cache") else "right")
    for row in rows:
        change = f"{row['vs_baseline']:+.2%}" if "vs_baseline" in row else ""
        name = Path(row["model"]).name  # the directory: the JSON has the whole path
        table.add_row(name, row["format"], row["kv_cache"], f"{row['perplexity']:.4f}", change)
    return table
