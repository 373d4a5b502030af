"""`kvq compress SRC OUT --recipe R`: FP8-block/BF16 checkpoint -> compressed-tensors INT4, shard by shard."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvq.byte_sizes import format_bytes
from kvq.checkpoint.validate import validate_dir
from kvq.checkpoint.writable import check_writable_dir
from kvq.commands.gptq_options import (
    CALIBRATED_METHODS,
    CalibrateKvOption,
    DatasetOption,
    ForwardDtypeOption,
    GptaqAlphaOption,
    GptqOptions,
    KvStrategyOption,
    MethodOption,
    MoeAllExpertsOption,
    MoeMinTokensOption,
    NumSamplesOption,
    SeedOption,
    SeqLenOption,
    TrueSequentialOption,
    gptq_compress,
)
from kvq.commands.recipe_options import GroupSizeOption, RecipeOption, TargetOption, warn_if_unmatched
from kvq.commands.render import console
from kvq.commands.resumable import resumable
from kvq.compress.manifest import MANIFEST_NAME
from kvq.compress.recipe import load_recipe
from kvq.compress.runner import CompressReport, PreparedJob, peak_rss_bound, prepare, run
from kvq.compress.tensor_plan import VLLM, KeptTensor
from kvq.errors import KvqError

_SHOWN_KEPT = 8


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def compress_command(
    src: Annotated[Path, typer.Argument(help="Source checkpoint directory (BF16/FP16/FP32 or FP8-block).")],
    out: Annotated[
        Path,
        typer.Argument(
            help="Output directory (new, empty, or an interrupted run of the same job, which is resumed)."
        ),
    ],
    recipe: RecipeOption,
    group_size: GroupSizeOption = None,
    target: TargetOption = VLLM,
    workers: Annotated[
        int, typer.Option(help="Shards compressed in parallel, one process each.")
    ] = default_workers(),
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    method: MethodOption = None,
    dataset: DatasetOption = None,
    num_samples: NumSamplesOption = None,
    seq_len: SeqLenOption = None,
    seed: SeedOption = None,
    moe_min_tokens: MoeMinTokensOption = None,
    moe_calibrate_all_experts: MoeAllExpertsOption = False,
    calibrate_kv: CalibrateKvOption = False,
    kv_strategy: KvStrategyOption = None,
    gptaq_alpha: GptaqAlphaOption = None,
    true_sequential: TrueSequentialOption = None,
    gptq_forward_dtype: ForwardDtypeOption = None,
) -> None:
    """Compress SRC into OUT as compressed-tensors pack-quantized INT4 (W4A16, symmetric) per the recipe.

    One job per source shard (cut into parts when there are fewer than 8 per worker), run on --workers
    processes; each reads only the tensors it needs (a weight_scale_inv in another shard included),
    dequantizes FP8 blocks, quantizes, packs and writes its shard under a temporary name, then renames
    it. Then the index, config.json (with the
    compressed-tensors quantization_config), tokenizer/generation files and kvq_manifest.json.

    Memory: tensors are streamed one at a time, so peak RSS is bounded by the workers, not by the model
    or shard size: about 0.5 GB + workers x (0.25 GB + the largest weight quantized, or FP8 weight
    written as BF16, as stored plus 2 bytes per element and 32 MiB, or the largest FP8 weight kept plus
    32 MiB, at least 64 MiB); printed at start.
    Target: vllm keeps FP8-block weights FP8, except those no engine runs in that form (a partial input
    block; a fused layer with partial output blocks), written as BF16; sglang writes every FP8 weight
    not quantized as BF16. Both are listed. Before any work SRC is checked against its config.json
    (layers, experts, every tensor's presence, shape and dtype: exit code 2, nothing written). After
    writing, `kvq check` runs on OUT and prints which engine loads it; exit code 1 when --target does not.
    Resume: re-run the same command on the same OUT; shards whose size and sha256 match the manifest are
    kept. SRC is never modified.

    --method gptq: GPTQ (llm-compressor's arithmetic) on calibration text, one decoder layer at a time
    (memory: one layer and the samples' hidden states, printed at start), then the same shards; a rerun
    resumes at the first layer not finished. --method gptaq: GPTAQ, the same with each Linear fitted to
    the full-precision model's outputs (its hidden states carried beside the quantized model's; routed
    experts stay GPTQ), each layer's Linears group by group (--true-sequential, its default).
    """
    workers = _usable_workers(workers)
    check_writable_dir(out, "OUT directory")  # before anything reads SRC (prepare checks it again)
    options = GptqOptions(
        method,
        dataset,
        num_samples,
        seq_len,
        seed,
        moe_min_tokens,
        moe_calibrate_all_experts,
        calibrate_kv,
        kv_strategy,
        gptaq_alpha,
        true_sequential,
        gptq_forward_dtype,
    )
    loaded = load_recipe(recipe, group_size)
    validate_dir(src)  # before any work: the weights are what config.json describes
    if options.method_for(loaded) in CALIBRATED_METHODS:
        written = gptq_compress(src, out, loaded, target, options, max(1, workers), quiet)
        _print_tensors("kept at source precision", written.kept)
        _print_tensors("FP8-block written as BF16", written.dequantized)
        _print_check(written.out, target)
        return
    job = prepare(src, out, loaded, target)
    warn_if_unmatched(job.plan, job.recipe)
    workers = max(1, workers)  # a few shards are cut into parts, so every worker has work
    console.print(
        f"kvq compress: {job.ckpt.root} ({job.ckpt.format}, {len(job.jobs)} shards, "
        f"{format_bytes(job.input_bytes)}) -> {job.out}, recipe {job.recipe.name} "
        f"(group {job.recipe.group_size}), target {target}, {workers} workers, peak memory <= ~"
        f"{format_bytes(peak_rss_bound(job.plan, workers))}"
    )
    with resumable("shards", job.out / MANIFEST_NAME):
        report = _run(job, workers, quiet)
    _print_report(report, job.input_bytes)
    _print_check(job.out, target)


def _usable_workers(workers: int) -> int:
    """--workers as given, or this machine's CPU count when it asks for more (more processes than CPUs
    only add memory: each holds its own tensors), said on stderr; refused below 1."""
    if workers < 1:
        raise KvqError(f"--workers {workers}: must be at least 1 (default {default_workers()})")
    num_cpus = os.cpu_count() or 1
    if workers > num_cpus:
        typer.echo(
            f"kvq compress: --workers {workers} is more than the {num_cpus} CPUs here: using {num_cpus}",
            err=True,
        )
        return num_cpus
    return workers


def _print_check(out: Path, target: str) -> None:
    """`kvq check` of OUT; exit code 1 when the `--target` engine would not load it."""
    from kvq.check import check_checkpoint
    from kvq.commands.check_cmd import print_report

    report = check_checkpoint(out)
    print_report(report)
    if not report.loads(target):
        print(
            f"kvq: error: {out}: written, but --target {target} does not load it (the errors above); "
            "fix what they name in SRC or the recipe, or pick the --target that loads it",
            file=sys.stderr,
        )
        raise typer.Exit(1)


def _run(job: PreparedJob, workers: int, quiet: bool) -> CompressReport:
    if quiet:
        return run(job, workers)
    from rich.progress import (  # here: --quiet runs start ~30 ms sooner
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("compressing", total=job.input_bytes)  # input bytes: bytes/s and ETA of the job
        return run(job, workers, progress=lambda n: bar.advance(task, n))


def _print_report(report: CompressReport, input_bytes: int) -> None:
    resumed = f", {len(report.shards_resumed)} kept from an earlier run" if report.shards_resumed else ""
    console.print(
        f"wrote {len(report.shards_written)} shard(s){resumed}: {format_bytes(input_bytes)} -> "
        f"{format_bytes(report.output_bytes)} in {report.wall_s:.1f} s -> {report.out}"
    )
    _print_tensors("kept at source precision", report.kept)
    _print_tensors("FP8-block written as BF16", report.dequantized)


def _print_tensors(title: str, tensors: list[KeptTensor]) -> None:
    if not tensors:
        return
    console.print(f"{title} ({len(tensors)}):")
    for kept in tensors[:_SHOWN_KEPT]:
        console.print(f"  {kept.name} {list(kept.shape)}: {kept.reason}")
    if len(tensors) > _SHOWN_KEPT:
        console.print(f"  ... and {len(tensors) - _SHOWN_KEPT} more (listed in {MANIFEST_NAME})")
