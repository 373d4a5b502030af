"""`kvq calibrate CKPT`: measure FP8 KV-cache scales layer by layer and write them into the checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvq.calibrate.calibration_config import STRATEGIES, CalibrationConfig
from kvq.checkpoint.validate import validate_dir
from kvq.commands.layer_progress import LayerProgress
from kvq.commands.render import console

if TYPE_CHECKING:  # the run module imports transformers' model classes: only load it when calibrating
    from kvq.calibrate.calibrate_checkpoint import CalibrationResult

_DEFAULTS = CalibrationConfig()


def render(result: CalibrationResult, root: Path) -> Table:
    record = result.record
    dataset = record["dataset"]
    table = Table(
        title=f"{root}: {result.layout.kind.upper()} KV scales, strategy {record['strategy']}",
        caption=f"{record['num_samples']} x {record['seq_len']} tokens of {dataset['source']} "
        f"({dataset['split']}), token ids sha256 {dataset['token_ids_sha256'][:16]}",
    )
    observed = result.layout.observed
    for col in ("layer", *(f"amax {name}" for name in observed), "k_scale", "v_scale"):
        table.add_column(col, justify="right")
    for row in record["layers"]:
        amax = [f"{max(row['amax'][name]):.4g}" for name in observed]
        table.add_row(str(row["layer"]), *amax, f"{max(row['k_scale']):.4g}", f"{max(row['v_scale']):.4g}")
    return table


def calibrate_command(
    path: Annotated[
        Path,
        typer.Argument(
            help="Checkpoint directory (BF16, FP8-block or kvq-compressed); scales are written into it."
        ),
    ],
    dataset: Annotated[
        Path | None,
        typer.Option(
            help="Calibration text: .txt (documents separated by blank "
            "lines) or .jsonl (a 'text' field per line). Default: "
            "Wikipedia articles bundled in gensim."
        ),
    ] = _DEFAULTS.dataset,
    num_samples: Annotated[
        int,
        typer.Option(
            help="Token windows to run. The defaults (128 x 2048 tokens) take about 3 min per decoder layer "
            "of a 135M model (SmolLM2-135M, 30 layers) on 2 busy Zen 4 vCPUs, about 19 min with torch held "
            "to AVX2 (the forward is bf16); time grows with samples. The run prints its estimate after "
            "the first layer."
        ),
    ] = _DEFAULTS.num_samples,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = _DEFAULTS.seq_len,
    strategy: Annotated[
        str, typer.Option(help=f"Scale granularity: {' | '.join(STRATEGIES)} (per KV head).")
    ] = _DEFAULTS.strategy,
    seed: Annotated[int, typer.Option(help="Seed of the window selection.")] = _DEFAULTS.seed,
) -> None:
    """Calibrate FP8 KV-cache scales (amax/448 of post-RoPE K and V, or of the MLA latent) one decoder layer
    at a time, and add them to the checkpoint: kv_scales.safetensors, index, config.json kv_cache_scheme,
    kvq_manifest.json."""
    config = CalibrationConfig(
        dataset=dataset, num_samples=num_samples, seq_len=seq_len, strategy=strategy, seed=seed
    )
    validate_dir(path)  # before the calibration run: the checkpoint is what its config.json says
    progress = LayerProgress("calibrating layers", Console(stderr=True))
    from kvq.calibrate.calibrate_checkpoint import calibrate  # torch and transformers: once every flag passed

    try:
        result = calibrate(path, config, on_start=progress.start, on_layer_done=progress.layer_done)
    finally:
        progress.stop()
    console.print(render(result, path))
