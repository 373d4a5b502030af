"""`kvq bench compress`: kvq compress vs llm-compressor's model_free_ptq vs the I/O floor, same input.

Input: the ~1.4 GB `size="bench"` glm4_moe FP8-block fixture (built once under `cache_dir()/bench`).
Each contender runs as a subprocess measured by `run_measured` (wall time, sampled peak RSS of the whole
process tree): `kvq compress --recipe w4a16-experts`; `model_free_ptq` with `FP8BlockDequantizer` and the
same recipe's config, on CPU; and the I/O floor, which reads every input shard and writes files of kvq's
output sizes (fsynced) on the same number of processes. Every run starts after `sync` (so no contender
pays for the writeback of the one before) with the input in the page cache; kvq and the floor run once
to warm up (the first write of this much data to fresh disk blocks took the floor 1.4-1.7 s instead of
0.8), then `repeats` times, alternately, and the median is reported.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvq.bench.json_output import JsonOption
from kvq.bench.measure import Measurement, run_measured
from kvq.byte_sizes import format_bytes
from kvq.commands.render import console
from kvq.paths import cache_dir

_CHUNK = 64 * 1024**2


@dataclass(frozen=True)
class CompressBenchConfig:
    arch: str = "glm4_moe"
    recipe: str = "w4a16-experts"
    workers: int = 2
    repeats: int = 3  # kvq and the I/O floor, alternately; model_free_ptq (~30x slower) runs once


@dataclass(frozen=True)
class Row:
    """A contender's median run (wall time and peak RSS), its output size and every run's wall time."""

    name: str
    wall_s: float
    peak_rss_bytes: int
    output_bytes: int
    returncode: int
    runs_s: tuple[float, ...] = ()


def bench_fixture(arch: str) -> Path:
    from kvq.fixtures.checkpoint_fixtures import build_fixture

    path = cache_dir() / "bench" / f"{arch}-fp8-block-bench"
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_fixture(arch, "fp8-block", path, size="bench")
    return path


def fp8_block_dequantizer(src: Path):
    """compressed-tensors' FP8BlockDequantizer for the FP8 modules of `src`, with its output made contiguous.

    Upstream returns a non-contiguous slice for weights with partial edge blocks (in_features 576, 2880 ...),
    which `save_file` then refuses; `.contiguous()` changes no value.
    """
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

    from kvq.checkpoint.reader import Checkpoint

    class ContiguousFP8BlockDequantizer(FP8BlockDequantizer):
        def process(self, tensors: dict) -> dict:
            return {name: t.contiguous() for name, t in super().process(tensors).items()}

    modules = sorted(
        n.removesuffix(".weight_scale_inv")
        for n in Checkpoint.open(src).tensors
        if n.endswith(".weight_scale_inv")
    )
    return ContiguousFP8BlockDequantizer(targets=modules)


def run_model_free_ptq(
    src: str,
    out: str,
    recipe: str,
    workers: int,
    group_size: int | None = None,
    extra_ignore: tuple[str, ...] = (),
) -> None:
    """llm-compressor's data-free PTQ of `src` driven by a kvq recipe (FP8 inputs dequantized to bf16 first).

    `extra_ignore`: modules to leave alone on top of the recipe's ignore list; model_free_ptq raises on a
    targeted Linear whose in_features the group size does not divide, where kvq keeps it at source precision.
    """
    from llmcompressor.entrypoints.model_free import model_free_ptq

    from kvq.checkpoint.reader import Checkpoint
    from kvq.compress.recipe import load_recipe

    is_fp8 = Checkpoint.open(src).format == "fp8-block"
    config = load_recipe(recipe, group_size).quantization_config()
    config.ignore = [*config.ignore, *extra_ignore]
    model_free_ptq(
        src,
        out,
        config=config,
        max_workers=workers,
        device="cpu",
        converter=fp8_block_dequantizer(Path(src)) if is_fp8 else None,
    )


def io_floor(src: str, out: str, output_sizes: dict[str, int], workers: int) -> None:
    """Read every input shard and write a file of its output's size, on `workers` processes."""
    from concurrent.futures import ProcessPoolExecutor

    shards = sorted(output_sizes)
    Path(out).mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_copy_one, [(str(Path(src) / s), str(Path(out) / s), output_sizes[s]) for s in shards]))


def _copy_one(item: tuple[str, str, int]) -> None:
    src, dst, size = item
    buf = bytearray(_CHUNK)
    written = 0
    with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
        while n := fin.readinto(buf):
            if written < size:
                take = min(n, size - written)
                fout.write(memoryview(buf)[:take])
                written += take
        while written < size:
            take = min(_CHUNK, size - written)
            fout.write(memoryview(buf)[:take])
            written += take
        os.fsync(fout.fileno())


def _warm(src: Path) -> None:
    buf = bytearray(_CHUNK)
    for shard in sorted(src.glob("*.safetensors")):
        with open(shard, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0


def _settle(src: Path) -> None:
    """The same start for every run: no dirty pages of an earlier run still being written back (which
    slowed whichever contender came next by up to 1.2 s), and the input in the page cache."""
    os.sync()
    _warm(src)


def _measure(name: str, argv: list[str], out: Path, src: Path) -> tuple[Measurement, int]:
    shutil.rmtree(out, ignore_errors=True)
    _settle(src)
    m = run_measured(argv)
    if m.returncode != 0:
        raise SystemExit(f"{name} failed ({m.returncode}):\n{m.output[-3000:]}")
    output_bytes = _dir_bytes(out)
    return m, output_bytes


def _median_row(name: str, runs: list[tuple[Measurement, int]]) -> Row:
    ordered = sorted(runs, key=lambda run: run[0].wall_s)
    median, output_bytes = ordered[len(ordered) // 2]
    walls = tuple(run[0].wall_s for run in runs)
    return Row(name, median.wall_s, median.peak_rss_bytes, output_bytes, median.returncode, walls)


def run_bench(config: CompressBenchConfig, work: Path) -> tuple[list[Row], dict]:
    src = bench_fixture(config.arch)
    work.mkdir(parents=True, exist_ok=True)
    py, w = sys.executable, str(config.workers)
    kvq_out, floor_out = work / "kvq", work / "floor"
    kvq_argv = [py, "-m", "kvq", "compress", str(src), str(kvq_out), "--recipe", config.recipe]
    kvq_argv += ["--workers", w, "--quiet"]
    kvq_runs, floor_runs = [], []
    for repeat in range(config.repeats + 1):  # run 0 is a warm-up of each, not counted
        kvq_run = _measure("kvq compress", kvq_argv, kvq_out, src)
        sizes = {p.name: p.stat().st_size for p in kvq_out.glob("*.safetensors")}
        floor_code = (
            f"from kvq.bench.compress import io_floor; io_floor({str(src)!r}, {str(floor_out)!r}, "
            f"{sizes!r}, {config.workers})"
        )
        floor_run = _measure("I/O floor", [py, "-c", floor_code], floor_out, src)
        if repeat:
            kvq_runs.append(kvq_run)
            floor_runs.append(floor_run)
    mfp_code = (
        f"from kvq.bench.compress import run_model_free_ptq; run_model_free_ptq({str(src)!r}, "
        f"{str(work / 'mfp')!r}, {config.recipe!r}, {config.workers})"
    )
    mfp_run = _measure("llm-compressor model_free_ptq", [py, "-c", mfp_code], work / "mfp", src)
    for out in (kvq_out, floor_out, work / "mfp"):
        shutil.rmtree(out, ignore_errors=True)
    machine = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "input_bytes": _dir_bytes(src),
        "source": str(src),
    }
    rows = [
        _median_row("kvq compress", kvq_runs),
        _median_row("llm-compressor model_free_ptq", [mfp_run]),
        _median_row("I/O floor (read inputs, write outputs)", floor_runs),
    ]
    return rows, machine


def render(rows: list[Row], workers: int) -> Table:
    kvq, mfp, floor = rows
    table = Table(title=f"kvq bench compress ({workers} workers)")
    for col in ("contender", "wall s (median)", "runs s", "peak RSS", "output", "vs kvq"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for row in rows:
        ratio = f"{row.wall_s / kvq.wall_s:.2f}x kvq time" if row is not kvq else "-"
        table.add_row(
            row.name,
            f"{row.wall_s:.2f}",
            " ".join(f"{t:.2f}" for t in row.runs_s),
            format_bytes(row.peak_rss_bytes),
            format_bytes(row.output_bytes),
            ratio,
        )
    table.caption = (
        f"kvq is {mfp.wall_s / kvq.wall_s:.1f}x faster than model_free_ptq (target >= 3x), "
        f"{kvq.peak_rss_bytes / max(1, mfp.peak_rss_bytes):.2f}x its peak RSS (target <= 0.5x), "
        f"{kvq.wall_s / floor.wall_s:.2f}x the I/O floor (target <= 2x)"
    )
    return table


def bench_compress_command(
    workers: Annotated[int, typer.Option(help="Workers for every contender.")] = 2,
    recipe: Annotated[str, typer.Option(help="Recipe for kvq and model_free_ptq.")] = "w4a16-experts",
    repeats: Annotated[
        int,
        typer.Option(help="Runs of kvq and of the I/O floor after a warm-up (median reported)."),
    ] = 3,
    json_out: JsonOption = None,
    method: Annotated[
        str,
        typer.Option(
            "--method",
            help="rtn: vs model_free_ptq and the I/O floor; gptq: vs llm-compressor oneshot GPTQModifier on "
            "the 8-layer glm4_moe bench fixture (BF16).",
        ),
    ] = "rtn",
    threads: Annotated[int, typer.Option(help="Torch threads of every contender (--method gptq).")] = 2,
) -> None:
    """Time and peak RSS of kvq compress vs llm-compressor model_free_ptq vs the I/O floor (1.4 GB FP8).

    Every run starts after `sync` with the input in the page cache."""
    if method == "gptq":
        _bench_gptq(json_out, workers, threads)
        return
    config = CompressBenchConfig(recipe=recipe, workers=workers, repeats=repeats)
    work = cache_dir() / "bench" / "compress-work"
    rows, machine = run_bench(config, work)
    console.print(render(rows, workers))
    path = json_out or cache_dir() / "bench" / "compress.json"
    path.write_text(
        json.dumps(
            {"config": asdict(config), "machine": machine, "rows": [asdict(r) for r in rows]}, indent=2
        )
    )
    console.print(f"results: {path}")


def _bench_gptq(json_out: Path | None, workers: int, threads: int) -> None:
    from kvq.bench.compress_gptq import GptqBenchConfig, render, run_gptq_bench

    config = GptqBenchConfig(workers=workers, threads=threads)
    report = run_gptq_bench(config, cache_dir() / "bench" / "compress-gptq-work")
    console.print(render(report))
    path = json_out or cache_dir() / "bench" / "compress-gptq.json"
    path.write_text(json.dumps(report, indent=2))
    console.print(f"results: {path}")
