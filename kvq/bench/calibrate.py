"""`kvq bench calibrate`: peak memory of layer-streamed calibration vs a full-model load, and what the
calibrated scales are worth in perplexity (SmolLM2, FP8 KV pages of the kvq runtime, as `kvq eval` scores).

Memory: `kvq calibrate` on an 8-layer glm4_moe bench fixture (FP8-block, and its BF16 twin) against a
subprocess that loads the whole BF16 model with transformers and runs the same number of tokens through
it; both measured by `run_measured` (sampled peak RSS of the process tree). Fixtures are built once under
`kvq.paths.cache_dir()/bench`; calibration writes into a linked copy (shards symlinked, JSON copied).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kvq.bench.measure import Measurement, run_measured
from kvq.byte_sizes import format_bytes
from kvq.commands.render import console
from kvq.paths import cache_dir

if TYPE_CHECKING:
    from kvq.calibrate.calibrate_checkpoint import CalibrationResult

PPL_KV_MEMORY = "1GiB"  # every window's pages at once (bf16: 16 x 512 tokens of SmolLM2 take 0.18 GiB)


@dataclass(frozen=True)
class CalibrateBenchConfig:
    """Every setting of the benchmark (the CLI flags default to these)."""

    arch: str = "glm4_moe"
    num_layers: int = 8
    num_samples: int = 32  # memory run: activations stay small next to one layer
    seq_len: int = 512
    threads: int = 2
    ppl_calib_samples: int = 32  # SmolLM2 (what `kvq bench decode` calibrates with)
    ppl_calib_seq_len: int = 512
    ppl_windows: int = 16  # every token a decode step of the runtime: affordable on 2 CPU cores
    ppl_seq_len: int = 512


def bench_fixture(arch: str, fmt: str, num_layers: int) -> Path:
    """The cached `size="bench"` fixture (built on first use, about a minute per GB)."""
    from kvq.fixtures.checkpoint_fixtures import build_fixture

    path = cache_dir() / "bench" / f"{arch}-{fmt}-bench-l{num_layers}"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_fixture(arch, fmt, path, num_layers=num_layers, size="bench")
    return path


def linked_copy(src: Path, dst: Path) -> Path:
    """`dst` with every shard of `src` symlinked and every other file copied: a writable view for free."""
    dst.mkdir(parents=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors" and item.name != "kv_scales.safetensors":
            (dst / item.name).symlink_to(item.resolve())
        elif item.is_file() and item.name not in ("kv_scales.safetensors", "kvq_manifest.json"):
            shutil.copy2(item, dst / item.name)
    index = dst / "model.safetensors.index.json"
    if index.exists():  # drop index entries of scales a previous calibration left in the source
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != "kv_scales.safetensors"}
        index.write_text(json.dumps(data))
    return dst


def full_model_forward(path: str, num_samples: int, seq_len: int, threads: int) -> None:
    """The baseline: the whole BF16 model in memory (transformers), `num_samples` x `seq_len` tokens run."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(
        3, model.config.vocab_size, (num_samples, seq_len), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        for row in ids:
            model(row.unsqueeze(0), use_cache=False, logits_to_keep=1)


def _env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}


def measure_rss(cfg: CalibrateBenchConfig, work: Path) -> list[dict]:
    """Peak RSS rows: kvq calibrate on the FP8-block and BF16 fixtures, and the full BF16 model."""
    rows = []
    bf16 = bench_fixture(cfg.arch, "bf16", cfg.num_layers)
    for fmt in ("fp8-block", "bf16"):
        ckpt = linked_copy(bench_fixture(cfg.arch, fmt, cfg.num_layers), work / fmt)
        argv = [
            sys.executable,
            "-m",
            "kvq",
            "calibrate",
            str(ckpt),
            "--num-samples",
            str(cfg.num_samples),
            "--seq-len",
            str(cfg.seq_len),
        ]
        rows.append(_row(f"kvq calibrate ({fmt})", argv, run_measured(argv, env=_env(cfg.threads))))
    code = (
        f"from kvq.bench.calibrate import full_model_forward; "
        f"full_model_forward({str(bf16)!r}, {cfg.num_samples}, {cfg.seq_len}, {cfg.threads})"
    )
    argv = [sys.executable, "-c", code]
    rows.append(
        _row("transformers full model load + forward (bf16)", argv, run_measured(argv, env=_env(cfg.threads)))
    )
    return rows


def _row(name: str, argv: list[str], m: Measurement) -> dict:
    if m.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {m.returncode}):\n{m.output[-3000:]}")
    return {
        "name": name,
        "command": " ".join(argv),
        "peak_rss_bytes": m.peak_rss_bytes,
        "wall_s": round(m.wall_s, 1),
    }


def runtime_perplexity(path: Path, kv_cache_dtype: str, windows: list[list[int]], threads: int) -> float:
    """`scoring.perplexity` of `windows`, every prediction a decode step over `kv_cache_dtype` KV pages."""
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine
    from kvq.runtime.scoring import perplexity

    config = EngineConfig(
        model=str(path),
        kv_cache_dtype=kv_cache_dtype,
        kv_memory=PPL_KV_MEMORY,
        threads=threads,
        max_num_seqs=len(windows),
    )
    return perplexity(Engine(config), windows)


def write_scales_copy(source: Path, dst: Path, result: CalibrationResult, strategy: str) -> Path:
    """A linked copy of `source` holding `strategy` scales from the maxima of calibration `result`, written
    as `kvq calibrate --strategy {strategy}` writes them."""
    from kvq.calibrate.scales import layer_scales
    from kvq.calibrate.write_scales import apply_update, prepare_update
    from kvq.checkpoint.reader import Checkpoint

    ckpt = Checkpoint.open(linked_copy(source, dst))
    scales: dict = {}
    for i in range(result.layout.num_layers):
        scales |= layer_scales(result.layout, strategy, i, result.recorder.amax[i])
    record = {**result.record, "strategy": strategy}
    apply_update(ckpt, scales, prepare_update(ckpt, scales, strategy, record))
    return dst


def measure_perplexity(cfg: CalibrateBenchConfig, work: Path) -> dict:
    """SmolLM2 perplexity on held-out Wikipedia through the runtime (`scoring.perplexity`, KV read from the
    paged pool by decode steps): BF16 pages, FP8 pages with scale 1.0 (no scales in the checkpoint), FP8
    pages with the scales of one `kvq calibrate` run (per tensor, and per head from the same maxima)."""
    import torch

    from kvq.calibrate.calibrate_checkpoint import calibrate, load_tokenizer
    from kvq.calibrate.calibration_config import CalibrationConfig
    from kvq.calibrate.samples import build_samples
    from kvq.data.embedded_model import ensure_smollm2
    from kvq.data.texts import DEFAULT_SOURCE, load_texts

    torch.set_num_threads(cfg.threads)
    source = ensure_smollm2().bf16
    windows = build_samples(
        load_texts(None, "held_out"),
        load_tokenizer(source),
        num_samples=cfg.ppl_windows,
        seq_len=cfg.ppl_seq_len,
        seed=0,
        source=f"{DEFAULT_SOURCE} (held_out)",
    )
    ids = windows.input_ids.tolist()
    rows = [
        {
            "kv_cache": "bf16 (no KV quantization)",
            "perplexity": runtime_perplexity(source, "bf16", ids, cfg.threads),
        },
        {
            "kv_cache": "fp8 e4m3, scale 1.0 (no calibration)",
            "perplexity": runtime_perplexity(source, "fp8_e4m3", ids, cfg.threads),
        },
    ]
    # One calibration run (the CLI defaults); per-tensor and per-head scales come from the same maxima.
    tensor = linked_copy(source, work / "smollm2-tensor")
    result = calibrate(
        tensor, CalibrationConfig(num_samples=cfg.ppl_calib_samples, seq_len=cfg.ppl_calib_seq_len)
    )
    per_head = write_scales_copy(source, work / "smollm2-attn_head", result, "attn_head")
    for strategy, path in (("tensor", tensor), ("attn_head", per_head)):
        rows.append(
            {
                "kv_cache": f"fp8 e4m3, kvq calibrate scales ({strategy})",
                "perplexity": runtime_perplexity(path, "fp8_e4m3", ids, cfg.threads),
            }
        )
    return {
        "model": str(source),
        "method": "kvq runtime, scoring.perplexity (teacher-forced decode steps over the paged KV pool)",
        "eval_windows": cfg.ppl_windows,
        "eval_seq_len": cfg.ppl_seq_len,
        "eval_text": windows.source,
        "eval_token_ids_sha256": windows.fingerprint,
        "calibration": {k: result.record[k] for k in ("dataset", "num_samples", "seq_len", "seed")},
        "rows": rows,
    }


def render(report: dict) -> None:
    if "rss" in report:
        table = Table(
            title=f"kvq bench calibrate: peak RSS, {report['config']['arch']} "
            f"{report['config']['num_layers']} layers, {report['config']['num_samples']} x "
            f"{report['config']['seq_len']} tokens"
        )
        for col in ("run", "peak RSS", "wall s"):
            table.add_column(col, justify="left" if col == "run" else "right")
        for row in report["rss"]:
            table.add_row(row["name"], format_bytes(row["peak_rss_bytes"]), f"{row['wall_s']:.1f}")
        table.caption = f"calibrate (fp8-block) / full model = {report['rss_ratio']:.3f}"
        console.print(table)
    if "perplexity" in report:
        ppl = report["perplexity"]
        table = Table(
            title=f"SmolLM2-135M perplexity, {ppl['eval_windows']} x {ppl['eval_seq_len']} held-out tokens"
        )
        table.add_column("KV cache")
        table.add_column("perplexity", justify="right")
        for row in ppl["rows"]:
            table.add_row(row["kv_cache"], f"{row['perplexity']:.4f}")
        console.print(table)


def bench_calibrate_command(
    out: Annotated[Path, typer.Option(help="Where to write the JSON report.")] = Path("bench-calibrate.json"),
    rss: Annotated[bool, typer.Option(help="Measure peak RSS (builds the bench fixtures once).")] = True,
    ppl: Annotated[
        bool, typer.Option("--perplexity/--no-perplexity", help="SmolLM2 FP8-KV perplexity.")
    ] = True,
    num_layers: Annotated[
        int, typer.Option(help="Decoder layers of the memory fixture.")
    ] = CalibrateBenchConfig.num_layers,
    threads: Annotated[int, typer.Option(help="CPU threads for every run.")] = CalibrateBenchConfig.threads,
) -> None:
    """Peak RSS of kvq calibrate vs a full-model load; SmolLM2 perplexity through the runtime with FP8 KV
    pages (calibrated scales vs the 1.0 fallback) and BF16 pages."""
    cfg = CalibrateBenchConfig(num_layers=num_layers, threads=threads)
    report: dict = {"config": asdict(cfg)}
    with tempfile.TemporaryDirectory(prefix="kvq-bench-calibrate-") as tmp:
        if rss:
            report["rss"] = measure_rss(cfg, Path(tmp))
            full = report["rss"][-1]["peak_rss_bytes"]
            report["rss_ratio"] = report["rss"][0]["peak_rss_bytes"] / full
        if ppl:
            report["perplexity"] = measure_perplexity(cfg, Path(tmp))
    out.write_text(json.dumps(report, indent=2) + "\n")
    render(report)
    console.print(f"wrote {out}")
