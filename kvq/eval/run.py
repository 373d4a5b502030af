"""`evaluate(model, baseline, config)`: every task on every run, through the kvq runtime; the report dict.

Runs: MODEL once per `--kv-cache-dtype`, and BASE with FP8 KV when it has calibrated scales (FP8 KV
alone). The reference is BASE with unquantized K/V, loaded once: its MMLU and GSM answers are computed
first, and it decodes the held-out windows beside each run (`kvq.eval.text`), so KL and agreement
compare the same positions. Inputs are read, never written. Imports torch (via kvq.runtime) and kvq.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kvq import __version__
from kvq.calibrate.samples import build_samples, token_fingerprint
from kvq.checkpoint.reader import Checkpoint
from kvq.compress.manifest import source_fingerprint
from kvq.errors import KvqError
from kvq.eval import gsm, metrics, mmlu
from kvq.eval.choices import argmax, choice_log_likelihoods
from kvq.eval.config import EvalConfig
from kvq.eval.text import WindowScores, score_windows
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine

Advance = Callable[[int], None]
Progress = Callable[[str, int], Advance]  # (what, total units) -> advance(n)
KV_NAMES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "float32": "fp32"}


def no_progress(_what: str, _total: int) -> Advance:
    return lambda _n: None


@dataclass(frozen=True)
class EngineSettings:
    """How every engine of an evaluation is built (besides the checkpoint and the KV dtype)."""

    dtype: str = EngineConfig.dtype
    baseline_dtype: str = EngineConfig.dtype
    kv_memory: str | int | None = None
    threads: int | None = None
    max_num_seqs: int = EngineConfig.max_num_seqs
    lm_head_weights: str = EngineConfig.lm_head_weights  # MODEL's runs only: the baseline keeps its own
    tp: int = EngineConfig.tp  # MODEL's runs only: the baseline, alive beside them, runs at --tp 1
    int4_compute: str = EngineConfig.int4_compute  # MODEL's runs only


@dataclass(frozen=True)
class Run:
    checkpoint: str  # "model" or "baseline": which checkpoint of the report
    path: Path
    kv_cache_dtype: str


@dataclass
class TaskData:
    """The items every engine answers, loaded once."""

    windows: list[list[int]] = field(default_factory=list)
    text_source: str = ""
    mmlu_items: list[mmlu.MmluItem] = field(default_factory=list)
    mmlu_shots: dict[str, list[mmlu.MmluItem]] = field(default_factory=dict)
    gsm_shots: list[gsm.GsmProblem] = field(default_factory=list)
    gsm_problems: list[gsm.GsmProblem] = field(default_factory=list)


@dataclass
class Answers:
    """One engine's answers: MMLU predicted choice per item by shot count, GSM completions."""

    mmlu: dict[int, list[int]] = field(default_factory=dict)
    gsm: list[str] = field(default_factory=list)


def has_kv_scales(path: Path) -> bool:
    return Checkpoint.open(path).quantization_config.get("kv_cache_scheme") is not None


def plan_runs(model: Path, baseline: Path | None, config: EvalConfig) -> list[Run]:
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
    runs = plan_runs(model, baseline, config)
    data = load_tasks(config)
    report: dict = {"kvq_version": __version__, "settings": _settings(config, data), "baseline": None}
    reference = None
    if baseline is not None:
        reference_kv = "bf16" if has_kv_scales(baseline) else "auto"  # never FP8: the unquantized reference
        reference = _engine(baseline, reference_kv, settings.baseline_dtype, settings)
        data.windows = _windows(reference, config, data)
        reference_answers = answer(reference, config, data, progress, "baseline")
        report["baseline"] = _describe(reference) | {"items": asdict(reference_answers)}
    report["runs"] = []
    for run in runs:
        engine = _engine(run.path, run.kv_cache_dtype, _dtype(run, settings), settings, run.checkpoint)
        if run.checkpoint == "model":
            report["model"] = _describe(engine)
        label = f"{Path(run.path).name}, KV {_kv_name(engine)}"
        if "text" in config.tasks:
            windows = _windows(engine, config, data)
            if data.windows and windows != data.windows:
                raise KvqError(
                    f"{run.path}: its tokenizer splits the text differently from {baseline}'s; compare "
                    "checkpoints of the same model (e.g. a compressed one and its source)"
                )
            data.windows = windows
        answers = answer(engine, config, data, progress, label)
        text = None
        if "text" in config.tasks:
            if reference is not None:
                reference.reset_kv()
            total = len(data.windows) * (config.seq_len - 1)
            text = score_windows(engine, data.windows, reference, progress(f"text: {label}", total))
        base_answers = None if reference is None else Answers(**report["baseline"]["items"])
        report["runs"].append(_run_report(run, engine, config, data, answers, base_answers, text))
        engine.close()  # its tensor-parallel ranks too, before the next run's start
        del engine
        gc.collect()
    if data.windows:
        report["settings"]["text_token_ids_sha256"] = token_fingerprint(torch.tensor(data.windows))
    return report


def load_tasks(config: EvalConfig) -> TaskData:
    from kvq.data.texts import DEFAULT_SOURCE, source_name

    data = TaskData()
    data.text_source = DEFAULT_SOURCE + " (held out)" if config.text is None else source_name(config.text)
    if "mmlu" in config.tasks:
        data.mmlu_items, data.mmlu_shots = mmlu.select(config.subjects, config.limit)
    if "gsm" in config.tasks:
        data.gsm_shots, data.gsm_problems = gsm.load_problems(
            config.gsm_seed, config.gsm_shots, config.num_gsm_problems
        )
    return data


def answer(engine: Engine, config: EvalConfig, data: TaskData, progress: Progress, label: str) -> Answers:
    """MMLU and GSM answers of one engine."""
    answers = Answers()
    if "mmlu" in config.tasks:
        for k in config.mmlu_shots:
            questions = [
                (mmlu.context(item, data.mmlu_shots[item.subject][:k]), mmlu.continuations())
                for item in data.mmlu_items
            ]
            advance = progress(f"MMLU {k}-shot: {label}", len(questions) * len(mmlu.CHOICE_LABELS))
            answers.mmlu[k] = [argmax(ll) for ll in choice_log_likelihoods(engine, questions, advance)]
    if "gsm" in config.tasks:
        prompts = [gsm.prompt(p, data.gsm_shots) for p in data.gsm_problems]
        advance = progress(f"GSM {config.gsm_shots}-shot: {label}", len(prompts))
        answers.gsm = gsm.generate(engine, prompts, config.gsm_max_tokens, advance)
    return answers


def _run_report(
    run: Run,
    engine: Engine,
    config: EvalConfig,
    data: TaskData,
    answers: Answers,
    base: Answers | None,
    text: WindowScores | None,
) -> dict:
    found: list[dict] = []
    items: dict = {}
    if text is not None:
        has_reference = bool(text.reference_nll)
        found.append(metrics.perplexity(text.nll, text.reference_nll or None, text.num_predicted))
        if has_reference:
            found.append(metrics.kl_divergence(text.kl, text.num_predicted))
            found.append(metrics.top1_agreement(text.num_agree, text.num_predicted))
        items["text"] = asdict(text)
    for k, predicted in answers.mmlu.items():
        correct = [p == item.answer for p, item in zip(predicted, data.mmlu_items, strict=True)]
        base_correct = None
        if base is not None:
            base_correct = [p == item.answer for p, item in zip(base.mmlu[k], data.mmlu_items, strict=True)]
        found.append(metrics.accuracy(f"mmlu_{k}shot", f"MMLU {k}-shot acc", correct, base_correct))
    if answers.gsm:
        found.append(
            metrics.accuracy(
                "gsm_strict",
                f"GSM {config.gsm_shots}-shot exact match",
                _gsm_correct(answers.gsm, data),
                None if base is None else _gsm_correct(base.gsm, data),
            )
        )
    items |= {"mmlu": {str(k): v for k, v in answers.mmlu.items()}, "gsm": answers.gsm}
    return {
        "checkpoint": run.checkpoint,
        "path": str(run.path),
        "kv_cache_dtype": run.kv_cache_dtype,
        "kv_cache": _kv_name(engine),
        "dtype": _dtype_name(engine),
        "metrics": found,
        "items": items,
    }


def _gsm_correct(completions: list[str], data: TaskData) -> list[bool]:
    return [gsm.is_correct(c, p) for c, p in zip(completions, data.gsm_problems, strict=True)]


def _engine(
    path: Path, kv_cache_dtype: str, dtype: str, settings: EngineSettings, checkpoint: str = "baseline"
) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            require_kv_scales=kv_cache_dtype == "fp8_e4m3",  # never FP8 with scale 1.0 in an eval
            kv_memory=settings.kv_memory,
            threads=settings.threads,
            max_num_seqs=settings.max_num_seqs,
            lm_head_weights=settings.lm_head_weights
            if checkpoint == "model"
            else EngineConfig.lm_head_weights,
            tp=settings.tp if checkpoint == "model" else 1,
            int4_compute=settings.int4_compute if checkpoint == "model" else EngineConfig.int4_compute,
        )
    )


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
        "lm_head_weights": engine.config.lm_head_weights,
        "int4_compute": engine.config.int4_compute,
    }


def _windows(engine: Engine, config: EvalConfig, data: TaskData) -> list[list[int]]:
    from kvq.data.texts import load_texts

    if "text" not in config.tasks:
        return []
    texts = load_texts(config.text, "held_out" if config.text is None else "all")
    samples = build_samples(
        texts,
        engine.tokenizer,
        num_samples=config.num_windows,
        seq_len=config.seq_len,
        seed=0,
        source=data.text_source,
    )
    return samples.input_ids.tolist()


def _settings(config: EvalConfig, data: TaskData) -> dict:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    settings["text_source"] = data.text_source
    settings["mmlu_items"] = {
        "index": [item.index for item in data.mmlu_items],
        "subject": [item.subject for item in data.mmlu_items],
        "answer": [item.answer for item in data.mmlu_items],
        "shots_per_subject": mmlu.NUM_HELD_SHOTS,
    }
    settings["gsm_problems"] = {
        "index": [p.index for p in data.gsm_problems],
        "reference": [p.reference for p in data.gsm_problems],
    }
    return settings
