"""`kvq compress` end to end: validate the whole job, run the shard jobs, then index, config and manifest.

`prepare` reads headers only and raises before anything is written (bad shards, missing or misshapen
scales, recipe problems, OUT inside SRC or not writable, OUT holding another job). `run` writes: output
shards through the worker pool (recording each in the manifest as it lands), then the index, config.json
with the compressed-tensors `quantization_config`, the tokenizer/generation files, and the completed manifest.
SRC is only ever read.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvq import __version__
from kvq.checkpoint.model_config import weight_prefix_of, with_quantization_config
from kvq.checkpoint.reader import CONFIG_NAME, INDEX_NAME, Checkpoint, block_size
from kvq.checkpoint.writable import check_writable_dir
from kvq.checkpoint.write import TMP_SUFFIX, tmp_path, write_index, write_json_atomic
from kvq.compress.jobs import CommitJob, Committed, Outcome, PartDone, ShardJob, ShardResult
from kvq.compress.manifest import (
    MANIFEST_NAME,
    describe_identity,
    differing_fields,
    job_identity,
    read_manifest,
    source_fingerprint,
    write_manifest,
)
from kvq.compress.output_config import quantization_config
from kvq.compress.parts import Parts
from kvq.compress.pool import run_jobs
from kvq.compress.recipe import Recipe
from kvq.compress.shard_files import COPY_CHUNK_BYTES, publish
from kvq.compress.tensor_plan import DEQUANTIZE, FP8_BLOCK, INT4, VLLM, CompressPlan, KeptTensor, build_plan
from kvq.errors import KvqError


@dataclass
class PreparedJob:
    """A validated job: nothing has been written yet."""

    ckpt: Checkpoint
    out: Path
    recipe: Recipe
    plan: CompressPlan
    identity: dict
    jobs: list[ShardJob]

    @property
    def input_bytes(self) -> int:
        return sum(job.input_bytes for job in self.jobs)


# Measured on this code (kvq bench compress, and one 33.5M-element weight): ~0.25 GB per Python process
# with torch; a weight being quantized is held as read (1 byte per element for FP8, 2 for BF16) plus
# ~0.9-1.2 bytes per element of outputs and cache-sized scratch (`quantize_rows` works in ~1M-element
# chunks); an FP8 weight kept is held as read; plain tensors are copied in 64 MiB chunks.
PROCESS_BASE_BYTES = 256 * 1024**2
INT4_EXTRA_BYTES_PER_ELEMENT = 2
SCRATCH_BYTES = 32 * 1024**2


def peak_rss_bound(plan: CompressPlan, workers: int) -> int:
    """Upper estimate of the process tree's peak RSS: CLI, forkserver, and each worker at its largest task."""
    largest = COPY_CHUNK_BYTES
    for task in plan.tasks:
        if task.action in (INT4, DEQUANTIZE):  # a BF16 result is 2 bytes per element, like INT4's outputs
            need = task.source.nbytes + INT4_EXTRA_BYTES_PER_ELEMENT * task.source.numel + SCRATCH_BYTES
            largest = max(largest, need)
        elif task.action == FP8_BLOCK:
            largest = max(largest, task.source.nbytes + SCRATCH_BYTES)
    return 2 * PROCESS_BASE_BYTES + workers * (PROCESS_BASE_BYTES + largest)


@dataclass
class CompressReport:
    out: Path
    shards_written: list[str] = field(default_factory=list)
    shards_resumed: list[str] = field(default_factory=list)
    output_bytes: int = 0
    kept: list[KeptTensor] = field(default_factory=list)
    dequantized: list[KeptTensor] = field(default_factory=list)
    wall_s: float = 0.0


def prepare(
    src: str | Path, out: str | Path, recipe: Recipe, target: str = VLLM, method: dict | None = None
) -> PreparedJob:
    """Open SRC (all headers), plan and validate every tensor for the serving `target`, check OUT; raise
    `KvqError` on any problem.

    `method`: how the INT4 weights are made when not round-to-nearest (GPTQ's settings and calibration
    fingerprint), part of the job's identity."""
    ckpt = Checkpoint.open(src)
    out = Path(out)
    _check_out_outside_src(ckpt.root, out)
    check_writable_dir(out, "OUT directory")
    plan = build_plan(ckpt.tensors, recipe, block_size(ckpt), target, weight_prefix_of(ckpt.config))
    identity = job_identity(recipe.identity(), source_fingerprint(ckpt), target)
    if method is not None:
        identity["method"] = method
    recorded = _recorded_shards(out, identity)
    jobs = [
        ShardJob(shard, out / shard, tuple(tasks), recipe.group_size, plan.block, recorded.get(shard))
        for shard, tasks in sorted(plan.shards.items())
    ]
    return PreparedJob(ckpt, out, recipe, plan, identity, jobs)


def run(job: PreparedJob, workers: int, progress: Callable[[int], None] | None = None) -> CompressReport:
    """Write the output directory (resuming a killed run of the same job); return what was done."""
    start = time.perf_counter()
    out = job.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(f"*{TMP_SUFFIX}"):  # left by a killed run: never complete
        stale.unlink()
    previous = read_manifest(out)
    shards = dict((previous or {}).get("shards", {}))
    if previous is None:
        write_manifest(out, manifest_header(job, shards, is_complete=False))
    report = CompressReport(out, kept=list(job.plan.kept), dequantized=list(job.plan.dequantized))
    weight_map: dict[str, str] = {}

    def on_done(result: ShardResult) -> None:
        weight_map.update(result.weight_map)
        (report.shards_resumed if result.is_resumed else report.shards_written).append(result.shard)
        report.output_bytes += result.file_bytes
        if not result.is_resumed:
            shards[result.shard] = {
                "bytes": result.file_bytes,
                "sha256": result.sha256,
                "tensor_bytes": result.tensor_bytes,
            }
            write_manifest(out, {"shards": dict(sorted(shards.items())), "complete": False})
            publish(out / result.shard)  # after the record: a final name is always a shard the manifest knows

    parts = Parts(job.jobs, workers)

    def on_outcome(outcome: Outcome) -> CommitJob | None:
        if isinstance(outcome, PartDone):
            return parts.done(outcome.shard)
        on_done(parts.result(outcome) if isinstance(outcome, Committed) else outcome)
        return None

    try:
        parts.create_files()
        run_jobs(parts.work, max(1, min(workers, len(parts.work))), on_outcome, progress)
    finally:
        for stale in out.glob(f"*{TMP_SUFFIX}"):
            stale.unlink()
    # A finished job re-run changes nothing, so it keeps what `kvq calibrate` added to index and config.
    if not (previous and previous.get("complete") and not report.shards_written):
        _finish(job, weight_map, shards)
    report.wall_s = time.perf_counter() - start
    return report


def _finish(job: PreparedJob, weight_map: dict[str, str], shards: dict) -> None:
    out, src = job.out, job.ckpt.root
    total = sum(shards[name]["tensor_bytes"] for name in set(weight_map.values()))
    write_index(out, weight_map, total)
    kv_cache_scheme = job.ckpt.quantization_config.get("kv_cache_scheme")
    num_layers = job.ckpt.config.get("num_hidden_layers")  # past it: MTP layers (none in a wrapper)
    quant = quantization_config(
        job.recipe, job.plan, kv_cache_scheme, num_layers if isinstance(num_layers, int) else None
    )
    write_json_atomic(with_quantization_config(job.ckpt.config, quant), out / CONFIG_NAME)
    for path in sorted(src.iterdir()):
        if _is_side_file(path):
            tmp = tmp_path(out / path.name)
            shutil.copyfile(path, tmp)
            tmp.replace(out / path.name)
    write_manifest(out, manifest_header(job, shards, is_complete=True))


def _is_side_file(path: Path) -> bool:
    """Tokenizer, generation config, chat template, license: plain files but weights and what kvq writes."""
    return (
        path.is_file()
        and not path.name.startswith(".")
        and path.suffix != ".safetensors"
        and path.name not in (CONFIG_NAME, INDEX_NAME, MANIFEST_NAME)
    )


def manifest_header(job: PreparedJob, shards: dict, *, is_complete: bool) -> dict:
    recipe = job.recipe
    return {
        "kvq_version": __version__,
        "job": job.identity,
        "recipe": {
            **recipe.identity(),
            "path": str(recipe.path),
            "targets": list(recipe.targets),
            "ignore": list(recipe.ignore),
            "text": recipe.path.read_text(),
        },
        "source": {
            "path": str(job.ckpt.root.resolve()),
            "fingerprint": job.identity["source_fingerprint"],
            "format": job.ckpt.format,
            "bytes": sum(header.file_bytes for header in job.ckpt.shards.values()),  # "before", for cards
        },
        "shards": dict(sorted(shards.items())),
        "target": job.plan.target,
        "kept_at_source_precision": _listed(job.plan.kept),
        "fp8_dequantized_to_bf16": _listed(job.plan.dequantized),
        "complete": is_complete,
    }


def _listed(tensors: list[KeptTensor]) -> list[dict]:
    return [{"name": k.name, "shape": list(k.shape), "reason": k.reason} for k in tensors]


def _check_out_outside_src(src: Path, out: Path) -> None:
    src_real, out_real = src.resolve(), out.resolve()
    if out_real == src_real or src_real in out_real.parents:
        raise KvqError(
            f"{out}: OUT is inside SRC ({src}); kvq never writes into the source: choose an OUT "
            "directory outside it"
        )
    if out_real in src_real.parents:
        raise KvqError(
            f"{out}: OUT contains SRC ({src}); choose an OUT directory that does not hold the source"
        )


def _recorded_shards(out: Path, identity: dict) -> dict[str, tuple[int, str]]:
    """Finished shards of an earlier run of this same job in OUT; error if OUT holds anything else."""
    if not out.exists():
        return {}
    if not out.is_dir():
        raise KvqError(f"{out}: exists and is not a directory; choose another OUT")
    manifest = read_manifest(out)
    if manifest is None:
        leftovers = [p.name for p in out.iterdir() if not p.name.endswith(TMP_SUFFIX)]
        if leftovers:
            raise KvqError(
                f"{out}: not empty ({', '.join(sorted(leftovers)[:3])}, ...) and holds no "
                f"{MANIFEST_NAME}; choose a new or empty OUT directory"
            )
        return {}
    if manifest.get("job") != identity:
        old = manifest.get("job") or {}
        raise KvqError(
            f"{out}: already holds a different job ({describe_identity(old)}; differs in "
            f"{', '.join(differing_fields(old, identity))}); this one is {describe_identity(identity)}: "
            "choose another OUT or delete it"
        )
    return {name: (rec["bytes"], rec["sha256"]) for name, rec in (manifest.get("shards") or {}).items()}
