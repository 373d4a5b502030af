"""`kvq compress --method gptq`: its options (calibration text as `kvq calibrate` takes it, MoE, KV scales)
and the run: the forward dtype decided once (`kvq.gptq.forward_dtype`), a progress bar over the decoder
layers with an ETA and, after the first layer, an estimate of the whole run; then a bar for writing the
shards.

Imports no torch until a GPTQ run starts, so `kvq compress --help` and RTN runs stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import typer

from kvq.byte_sizes import format_bytes
from kvq.calibrate.calibration_config import STRATEGIES, CalibrationConfig
from kvq.commands.layer_progress import LayerProgress
from kvq.commands.render import console
from kvq.commands.resumable import resumable
from kvq.compress.manifest import MANIFEST_NAME
from kvq.compress.recipe import Recipe
from kvq.compress.runner import CompressReport
from kvq.errors import KvqError
from kvq.gptq.forward_dtype import DEFAULT_FORWARD_DTYPE, FORWARD_DTYPES, check_forward_dtype
from kvq.gptq.gptq_config import GPTAQ_ALPHA, GptqConfig

METHODS = ("rtn", "gptq", "gptaq")
CALIBRATED_METHODS = ("gptq", "gptaq")
_DEFAULTS = GptqConfig()
_CALIBRATION = _DEFAULTS.calibration
_SHOWN_FALLBACKS = 8

MethodOption = Annotated[
    str | None,
    typer.Option(
        "--method",
        help="How INT4 weights are chosen: rtn (round-to-nearest, data-free; the default), gptq "
        "(calibrated on text, one decoder layer at a time; llm-compressor's arithmetic) or gptaq (GPTQ "
        "fitted to the full-precision model's outputs, whose states are carried too: GPTAQ, asymmetric "
        "calibration; loses less, one more forward per sample and layer). A GPTQModifier recipe means "
        "gptq unless gptaq is asked for.",
    ),
]
GptaqAlphaOption = Annotated[
    float | None,
    typer.Option(
        "--gptaq-alpha",
        help=f"--method gptaq: the scale of its correction toward the full-precision outputs, in [0, 1] "
        f"(0 gives GPTQ's codes) (default: {GPTAQ_ALPHA}, the reference implementation's).",
    ),
]
TrueSequentialOption = Annotated[
    bool | None,
    typer.Option(
        "--true-sequential/--no-true-sequential",
        help="Within each decoder layer, calibrate its Linears group by group in the order the forward "
        "reaches them (llama: q/k/v, o, gate/up, down), each group on the inputs the quantized groups "
        "before it give (the GPTQ and GPTAQ reference implementations' option; llm-compressor calibrates "
        "a whole layer at once). One more forward per group, sample and layer. Default: on for gptaq, "
        "off for gptq (llm-compressor's arithmetic).",
        show_default=False,
    ),
]
DatasetOption = Annotated[
    Path | None,
    typer.Option(
        "--dataset",
        help="GPTQ calibration text: .txt (documents separated by blank lines) or .jsonl (a 'text' field "
        "per line). Default: the Wikipedia articles bundled in gensim (calibration split).",
    ),
]
NumSamplesOption = Annotated[
    int | None,
    typer.Option(
        "--num-samples",
        help=f"GPTQ: token windows to calibrate on (default: {_CALIBRATION.num_samples}). The defaults, "
        f"{_CALIBRATION.num_samples} x {_CALIBRATION.seq_len} tokens, cost about 6.5 CPU-minutes per decoder "
        "layer of a 135M model (SmolLM2-135M, 30 layers; about 19 min a layer on 2 busy Zen 4 vCPUs) where "
        "the forward runs fast (float32 on an AVX2 CPU, bf16 with AVX-512 BF16), 3x that or more with a "
        "bf16 forward on an AVX2-only CPU; time grows with samples. The run prints its own estimate after "
        "the first layer.",
    ),
]
SeqLenOption = Annotated[
    int | None, typer.Option("--seq-len", help=f"GPTQ: tokens per window (default: {_CALIBRATION.seq_len}).")
]
SeedOption = Annotated[
    int | None,
    typer.Option("--seed", help=f"GPTQ: seed of the window selection (default: {_CALIBRATION.seed})."),
]
MoeMinTokensOption = Annotated[
    int | None,
    typer.Option(
        "--moe-min-tokens",
        help="GPTQ: an expert routed fewer calibration tokens than this keeps round-to-nearest (listed "
        f"in the report and the manifest) (default: {_DEFAULTS.moe_min_tokens}).",
    ),
]
MoeAllExpertsOption = Annotated[
    bool,
    typer.Option(
        "--moe-calibrate-all-experts",
        help="GPTQ: every token feeds every expert's Hessians (the output still follows the real routing).",
    ),
]
CalibrateKvOption = Annotated[
    bool,
    typer.Option(
        "--calibrate-kv",
        help="GPTQ: also write FP8 KV-cache scales measured in the same pass on the quantized model.",
    ),
]
ForwardDtypeOption = Annotated[
    str | None,
    typer.Option(
        "--gptq-forward-dtype",
        help=f"GPTQ: dtype of the calibration forward, {' | '.join(FORWARD_DTYPES)}. bfloat16 is "
        "llm-compressor's arithmetic (its weight_packed bytes exactly); float32 runs fast on CPUs without "
        "native bf16 (AVX2 only: no avx512_bf16 / AMX, where bf16 matmuls are emulated) and changes some "
        "codes (other Hessians: 5% of SmolLM2's layer 0; see README). auto: bfloat16 where torch computes "
        f"bf16 natively, else float32 (default: {DEFAULT_FORWARD_DTYPE}).",
    ),
]
KvStrategyOption = Annotated[
    str | None,
    typer.Option(
        "--kv-strategy",
        help=f"With --calibrate-kv: {' | '.join(STRATEGIES)} (default: {_CALIBRATION.strategy}).",
    ),
]


@dataclass(frozen=True)
class GptqOptions:
    """The GPTQ options as given on the command line (None: not given)."""

    method: str | None = None
    dataset: Path | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    moe_min_tokens: int | None = None
    moe_calibrate_all_experts: bool = False
    calibrate_kv: bool = False
    kv_strategy: str | None = None
    gptaq_alpha: float | None = None
    true_sequential: bool | None = None
    gptq_forward_dtype: str | None = None

    def method_for(self, recipe: Recipe) -> str:
        """rtn, gptq or gptaq; `KvqError` for a contradiction or options of another method."""
        if self.method is not None and self.method not in METHODS:
            raise KvqError(f"--method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        method = self.method or ("gptq" if recipe.gptq is not None else "rtn")
        if method == "rtn" and recipe.gptq is not None:
            raise KvqError(
                f"{recipe.path}: the recipe is a GPTQModifier, which asks for GPTQ; drop --method rtn, or "
                "use a QuantizationModifier recipe for round-to-nearest"
            )
        given = [
            f"--{k.replace('_', '-')}"
            for k, v in vars(self).items()
            if k != "method" and v not in (None, False)
        ]
        if method == "rtn" and given:
            raise KvqError(f"{', '.join(given)} only apply to --method gptq; add --method gptq or drop them")
        if method != "gptaq" and self.gptaq_alpha is not None:
            raise KvqError("--gptaq-alpha only applies to --method gptaq; add --method gptaq or drop it")
        if self.gptq_forward_dtype is not None:
            check_forward_dtype(self.gptq_forward_dtype)
        return method

    def config(self, dtype: str = _CALIBRATION.dtype) -> GptqConfig:
        """The run's config, its calibration forward in `dtype` (`resolve_forward_dtype`'s answer)."""
        calibration = CalibrationConfig(
            dataset=self.dataset,
            num_samples=_given(self.num_samples, _CALIBRATION.num_samples),
            seq_len=_given(self.seq_len, _CALIBRATION.seq_len),
            seed=_given(self.seed, _CALIBRATION.seed),
            strategy=_given(self.kv_strategy, _CALIBRATION.strategy),
            dtype=dtype,
        )
        return replace(
            _DEFAULTS,
            calibration=calibration,
            moe_min_tokens=_given(self.moe_min_tokens, _DEFAULTS.moe_min_tokens),
            moe_calibrate_all_experts=self.moe_calibrate_all_experts,
            calibrate_kv=self.calibrate_kv,
            gptaq_alpha=_given(self.gptaq_alpha, GPTAQ_ALPHA) if self.method == "gptaq" else None,
            true_sequential=self.method == "gptaq" if self.true_sequential is None else self.true_sequential,
        )


def _given(value: object, default: object):  # noqa: ANN202
    return default if value is None else value


def gptq_compress(
    src: Path, out: Path, recipe: Recipe, target: str, options: GptqOptions, workers: int, quiet: bool
) -> CompressReport:
    """Validate, print what will run (with the memory bound and the forward dtype), run with progress bars
    and an estimate after the first layer, print the GPTQ report; return the shards' report (what was
    kept or dequantized is listed by the caller)."""
    from kvq.gptq.forward_dtype import resolve_forward_dtype
    from kvq.gptq.gptq_job import prepare_gptq

    forward = resolve_forward_dtype(options.gptq_forward_dtype or DEFAULT_FORWARD_DTYPE)
    job = prepare_gptq(src, out, recipe, options.config(forward.dtype), target)
    console.print(_start_line(job, recipe, target, workers) + f"; forward {forward.dtype} ({forward.reason})")
    with resumable("layers and shards", job.compress.out / MANIFEST_NAME):
        report = _run(job, workers, quiet)
    _print_report(report, job.compress.input_bytes)
    return report.compress


def _start_line(job, recipe: Recipe, target: str, workers: int) -> str:  # noqa: ANN001 (a GptqJob)
    from kvq.gptq.memory import gptq_peak_bound

    c, s = job.config.calibration, job.settings
    bound = gptq_peak_bound(
        job.lm,
        job.text.fields,
        job.compress.plan,
        job.targets,
        job.layer_names,
        (c.num_samples, c.seq_len),
        c.dtype,
        workers,
        gptaq=job.config.gptaq_alpha is not None,
        true_sequential=job.config.true_sequential,
    )
    method = "gptq" if job.config.gptaq_alpha is None else f"gptaq (alpha {job.config.gptaq_alpha})"
    if job.config.true_sequential:
        method += " --true-sequential"
    return (
        f"kvq compress --method {method}: {job.compress.ckpt.root} ({job.compress.ckpt.format}, "
        f"{job.num_layers} layers, {format_bytes(job.compress.input_bytes)}) -> {job.compress.out}, recipe "
        f"{recipe.name} (group {recipe.group_size}), target {target}, block_size {s.block_size}, "
        f"dampening_frac {s.dampening_frac}, actorder {s.actorder}; calibration {c.num_samples} x "
        f"{c.seq_len} tokens of {job.samples.source} (token ids sha256 {job.samples.fingerprint[:12]}); "
        f"{workers} workers, peak memory <= ~{format_bytes(bound)}"
    )


def _run(job, workers: int, quiet: bool):  # noqa: ANN001, ANN202 (GptqJob, GptqReport: torch-side types)
    """The layers' bar (with --quiet only the estimate line), then the shards' bar on the same display."""
    from kvq.gptq.gptq_job import run_gptq

    name = "GPTQ" if job.config.gptaq_alpha is None else "GPTAQ"
    layers = LayerProgress(f"{name} layers", console, show_bar=not quiet)
    layers.start(job.num_layers)
    try:
        bar = layers.progress
        if bar is None:
            return run_gptq(job, workers, layers.layer_done)
        shards = bar.add_task("writing shards (bytes)", total=None)
        return run_gptq(
            job,
            workers,
            layers.layer_done,
            lambda n: bar.advance(shards, n),
            lambda total: bar.update(shards, total=total),
        )
    finally:
        layers.stop()


def _print_report(report, input_bytes: int) -> None:  # noqa: ANN001 (a GptqReport)
    compress = report.compress
    console.print(
        f"GPTQ: {report.num_gptq} module(s) calibrated, {len(report.layers_done)} layer(s) run"
        f"{f', {report.layers_resumed} resumed' if report.layers_resumed else ''}; wrote "
        f"{len(compress.shards_written)} shard(s) ({len(compress.shards_resumed)} kept): "
        f"{format_bytes(input_bytes)} -> {compress.out}"
        f"{'; KV scales written' if report.kv_scales_written else ''}"
    )
    if report.rtn_fallback:
        console.print(f"round-to-nearest instead of GPTQ ({len(report.rtn_fallback)}):")
        for name, reason in list(sorted(report.rtn_fallback.items()))[:_SHOWN_FALLBACKS]:
            console.print(f"  {name}: {reason}")
        if len(report.rtn_fallback) > _SHOWN_FALLBACKS:
            console.print(
                f"  ... and {len(report.rtn_fallback) - _SHOWN_FALLBACKS} more (in kvq_manifest.json)"
            )
