"""`evaluate(model, baseline, config)`: every task on every run, through the kvq runtime; the report dict.

Runs: MODEL once per `--kv-cache-dtype`, and BASE with FP8 KV when it has calibrated scales (FP8 KV
alone). The reference is BASE with unquantized K/V, loaded once: its lm-eval task answers are computed
first (`kvq.eval.lm.KvqLM` through lm-eval), and it decodes the held-out windows beside each run
(`kvq.eval.text`), so KL and agreement compare the same positions. Inputs are read, never written.
Imports torch (via kvq.runtime), lm_eval and kvq.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvq import __version__
from kvq.calibrate.samples import build_samples, token_fingerprint
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import source_fingerprint
from kvq.errors import KvqError
from kvq.eval.eval_config import EvalConfig
from kvq.eval.harness import TaskResult, run_tasks, task_manager
from kvq.eval.lm import KvqLM, Progress, no_progress
from kvq.eval.run_report import run_entry, task_items
from kvq.eval.text import score_windows
from kvq.runtime.config import EngineConfig
from kvq.runtime.distributed.worker import follow_under_launcher
from kvq.runtime.engine import Engine

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

KV_NAMES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "float32": "fp32"}
ENGINE_NAME = "kvq runtime"


@dataclass(frozen=True)
class EngineSettings:
    """How every engine of an evaluation is built (besides the checkpoint and the KV dtype)."""

    dtype: str = EngineConfig.dtype
    baseline_dtype: str = EngineConfig.dtype
    kv_memory: str | int | None = None
    threads: int | None = None
    max_num_seqs: int = EngineConfig.max_num_seqs
    lm_head_weights: str = EngineConfig.lm_head_weights  # MODEL's runs only: the baseline's is stored
    tp: int = EngineConfig.tp  # MODEL's runs only: the baseline, alive beside them, runs at --tp 1
    int4_compute: str = EngineConfig.int4_compute  # MODEL's runs only
    speculative: str | None = EngineConfig.speculative  # MODEL's runs only: the baseline decodes plainly
    num_speculative_tokens: int = EngineConfig.num_speculative_tokens


@dataclass(frozen=True)
class Run:
    checkpoint: str  # "model" or "baseline": which checkpoint of the report
    path: Path
    kv_cache_dtype: str


@dataclass
class Shared:
    """What every run of one evaluation uses: the task finder and the held-out windows."""

    manager: object
    windows: list[list[int]] = field(default_factory=list)
    text_source: str = ""


def has_kv_scales(path: Path) -> bool:
    return Checkpoint.open(path).quantization_config.get("kv_cache_scheme") is not None


def eval_runs(model: Path, baseline: Path | None, config: EvalConfig) -> list[Run]:
    runs = [Run("model", model, kv) for kv in config.kv_cache_dtypes]
    if baseline is not None and "fp8_e4m3" in config.kv_cache_dtypes and has_kv_scales(baseline):
        runs.append(Run("baseline", baseline, "fp8_e4m3"))
    return runs


def evaluate(
    model: Path,
    baseline: Path | None,
    config: EvalConfig,
    settings: EngineSettings = EngineSettings(),
    progress: Progress = no_progress,
) -> dict:
    """Every task of `config` on every run; the report `kvq eval --json` writes."""
    runs = eval_runs(model, baseline, config)
    shared = Shared(task_manager(config.include_paths, config.lm_eval_tasks), text_source=text_source(config))
    report: dict = {"kvq_version": __version__, "engine": {"name": ENGINE_NAME, "version": __version__}}
    report |= {"settings": settings_of(config, shared.text_source), "baseline": None}
    reference, reference_tasks = None, None
    if baseline is not None:
        reference_kv = "bf16" if has_kv_scales(baseline) else "auto"  # never FP8: the unquantized reference
        reference = _engine(baseline, reference_kv, settings.baseline_dtype, settings)
        shared.windows = _windows(reference, config, shared)
        reference_tasks = _tasks(reference, config, shared, progress, "baseline")
        items = {name: task_items(r) for name, r in reference_tasks.items()}
        report["baseline"] = _describe(reference) | {"items": {"tasks": items}}
    report["runs"] = []
    for run in runs:
        engine = _engine(run.path, run.kv_cache_dtype, _dtype(run, settings), settings, run.checkpoint)
        if run.checkpoint == "model":
            report["model"] = _describe(engine)
        report["runs"].append(_run(run, engine, reference, reference_tasks, config, shared, progress))
        engine.close()  # its tensor-parallel ranks too, before the next run's start
        del engine
        gc.collect()
    report["settings"]["task_versions"] = versions_of(report["runs"][0])
    if shared.windows:
        report["settings"]["text_token_ids_sha256"] = token_fingerprint(torch.tensor(shared.windows))
    return report


def _run(
    run: Run,
    engine: Engine,
    reference: Engine | None,
    reference_tasks: dict[str, TaskResult] | None,
    config: EvalConfig,
    shared: Shared,
    progress: Progress,
) -> dict:
    label = f"{Path(run.path).name}, KV {_kv_name(engine)}"
    text = None
    if config.has_text:
        windows = _windows(engine, config, shared)
        if shared.windows and windows != shared.windows:
            raise KvqError(
                f"{run.path}: its tokenizer splits the text differently from the baseline's; compare "
                "checkpoints of the same model (e.g. a compressed one and its source)"
            )
        shared.windows = windows
    tasks = _tasks(engine, config, shared, progress, label)
    if config.has_text:
        if reference is not None:
            reference.reset_kv()
        total = len(shared.windows) * (config.seq_len - 1)
        text = score_windows(engine, shared.windows, reference, progress(f"text: {label}", total))
    meta = {"checkpoint": run.checkpoint, "path": str(run.path), "kv_cache_dtype": run.kv_cache_dtype}
    meta |= {"kv_cache": _kv_name(engine), "dtype": _dtype_name(engine)}
    return run_entry(meta, tasks, reference_tasks, text)


def _tasks(
    engine: Engine, config: EvalConfig, shared: Shared, progress: Progress, label: str
) -> dict[str, TaskResult]:
    lm = KvqLM(engine, label, progress)
    return run_tasks(lm, config.lm_eval_tasks, shared.manager, config.limit, config.num_fewshot)


def text_source(config: EvalConfig) -> str:
    from kvq.data.texts import DEFAULT_SOURCE, source_name

    return DEFAULT_SOURCE + " (held out)" if config.text is None else source_name(config.text)


def _engine(
    path: Path, kv_cache_dtype: str, dtype: str, settings: EngineSettings, checkpoint: str = "baseline"
) -> Engine:
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        require_kv_scales=kv_cache_dtype == "fp8_e4m3",  # never FP8 with scale 1.0 in an eval
        kv_memory=settings.kv_memory,
        threads=settings.threads,
        max_num_seqs=settings.max_num_seqs,
        # the baseline is the source as stored: the runtime's INT8 lm_head copy is measured, not assumed
        lm_head_weights=settings.lm_head_weights if checkpoint == "model" else "stored",
        tp=settings.tp if checkpoint == "model" else 1,
        int4_compute=settings.int4_compute if checkpoint == "model" else EngineConfig.int4_compute,
        speculative=settings.speculative if checkpoint == "model" else None,
        num_speculative_tokens=settings.num_speculative_tokens,
    )
    if checkpoint == "model":
        follow_under_launcher(config)  # under torchrun, ranks past 0 run MODEL's steps and end here
    return Engine(config)


def _dtype(run: Run, settings: EngineSettings) -> str:
    return settings.dtype if run.checkpoint == "model" else settings.baseline_dtype


def _kv_name(engine: Engine) -> str:
    name = str(engine.kv_pool.dtype).removeprefix("torch.")
    return KV_NAMES.get(name, name)


def _dtype_name(engine: Engine) -> str:
    return str(engine.config.activation_dtype).removeprefix("torch.")


def _describe(engine: Engine) -> dict:
    return {
        "path": str(engine.ckpt.root),
        "fingerprint": source_fingerprint(engine.ckpt),
        "format": engine.ckpt.format,
        "kv_cache": _kv_name(engine),
        "dtype": _dtype_name(engine),
        "lm_head_weights": engine.model.lm_head_mode,
        "int4_compute": engine.config.int4_compute,
    }


def _windows(engine: Engine, config: EvalConfig, shared: Shared) -> list[list[int]]:
    if not config.has_text:
        return []
    return text_windows(engine.tokenizer, config, shared.text_source)


def text_windows(tokenizer: PreTrainedTokenizerBase, config: EvalConfig, source: str) -> list[list[int]]:
    """The held-out windows every run scores (token ids), the same for a served model."""
    from kvq.data.texts import load_texts

    texts = load_texts(config.text, "held_out" if config.text is None else "all")
    samples = build_samples(
        texts, tokenizer, num_samples=config.num_windows, seq_len=config.seq_len, seed=0, source=source
    )
    return samples.input_ids.tolist()


def settings_of(config: EvalConfig, source: str) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    settings["include_paths"] = [str(p) for p in config.include_paths]
    settings["text_source"] = source
    return settings


def versions_of(run: dict) -> dict[str, dict]:
    """task -> its lm-eval version and shots, as the run's items recorded them."""
    return {
        name: {"version": t["version"], "num_fewshot": t["num_fewshot"]}
        for name, t in run["items"]["tasks"].items()
    }
