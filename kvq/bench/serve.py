"""`kvq bench serve`: throughput and latency of OpenAI-compatible servers (kvq's, vLLM's, ...) under load.

For each server (one at a time: started for its turn when kvq launches it) and each concurrency level:
a warm-up request, then `num_prompts` streaming completions with at most `concurrency` in flight
(`kvq.bench.serve_load`): output and total tok/s, request/s, TTFT, TPOT, ITL and end-to-end latency at
p50/p95/p99. A rich table, a JSON file and a PNG plot (throughput and latency against concurrency, one
line per server). Prompts: the first words of the bundled Wikipedia articles, or `--dataset`.
Imports httpx, rich, typer, matplotlib (for the plot) and kvq.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvq.bench.json_output import JsonOption
from kvq.bench.serve_load import LevelResult, run_level, served_model, summarize
from kvq.bench.serve_plot import plot_levels
from kvq.bench.serve_servers import ServerSpec, parse_servers, server_up
from kvq.commands.render import console
from kvq.errors import KvqError


@dataclass(frozen=True)
class ServeBenchConfig:
    """Every setting of the load (the CLI flags default to these)."""

    concurrency: tuple[int, ...] = (1, 8, 32, 64)
    num_prompts: int = 64  # per concurrency level (at least the concurrency)
    max_tokens: int = 64
    prompt_words: int = 48  # words of each default prompt


def parse_concurrency(value: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(v) for v in value.split(","))
    except ValueError as e:
        raise KvqError(f"--concurrency {value!r}: expected comma-separated integers, e.g. 1,8,32,64") from e
    if not levels or min(levels) < 1:
        raise KvqError(f"--concurrency {value!r}: every level must be >= 1")
    return levels


def load_prompts(dataset: Path | None, config: ServeBenchConfig) -> list[str]:
    """Prompts from a .jsonl (a `prompt` or `text` field per line) or .txt (one per line) file, or the
    bundled Wikipedia articles' first `prompt_words` words."""
    if dataset is None:
        from kvq.data.texts import load_texts

        texts = load_texts(None, "held_out")
        return [" ".join(t.split()[: config.prompt_words]) for t in texts]
    try:
        lines = [line for line in dataset.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise KvqError(f"--dataset {dataset}: cannot read it ({e.strerror})") from e
    if dataset.suffix == ".jsonl":
        try:
            rows = [json.loads(line) for line in lines]
            prompts = [str(r.get("prompt", r.get("text"))) for r in rows if "prompt" in r or "text" in r]
        except (json.JSONDecodeError, AttributeError) as e:
            raise KvqError(f"--dataset {dataset}: each line must be a JSON object with a prompt field") from e
    else:
        prompts = lines
    if not prompts:
        raise KvqError(f"--dataset {dataset}: no prompts found")
    return prompts


def bench_server(
    spec: ServerSpec, prompts: list[str], config: ServeBenchConfig, api_key: str | None, log: Path | None
) -> list[LevelResult]:
    results = []
    with server_up(spec, log) as url:
        model = served_model(url, api_key)
        for concurrency in config.concurrency:
            n = max(config.num_prompts, concurrency)
            batch = [prompts[i % len(prompts)] for i in range(n)]
            asyncio.run(run_level(url, model, batch[:1], 1, 4, api_key))  # warm-up
            records = asyncio.run(run_level(url, model, batch, concurrency, config.max_tokens, api_key))
            result = summarize(records, concurrency)
            console.print(
                f"{spec.label} c={concurrency}: {result.output_tok_s:.1f} output tok/s, "
                f"TTFT p50 {result.ttft_s['p50']:.2f} s, {result.num_failed} failed"
            )
            results.append(result)
    return results


def render(results: dict[str, list[LevelResult]]) -> Table:
    table = Table(title="kvq bench serve")
    for column in ("server", "conc.", "req/s", "output tok/s", "total tok/s", "TTFT p50/p95/p99 s",
                   "TPOT p50/p95/p99 ms", "ITL p50/p95/p99 ms", "e2e p50/p95/p99 s", "failed"):  # fmt: skip
        table.add_column(column, justify="left" if column == "server" else "right")

    def three(d: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
        return " / ".join(f"{d[p] * scale:.{digits}f}" for p in ("p50", "p95", "p99"))

    for label, levels in results.items():
        for r in levels:
            table.add_row(
                label,
                str(r.concurrency),
                f"{r.request_s:.2f}",
                f"{r.output_tok_s:.1f}",
                f"{r.total_tok_s:.1f}",
                three(r.ttft_s),
                three(r.tpot_s, 1e3, 1),
                three(r.itl_s, 1e3, 1),
                three(r.e2e_s),
                str(r.num_failed),
                end_section=r is levels[-1],
            )
    return table


def bench_serve_command(
    url: Annotated[list[str] | None, typer.Option(help="A running server, [LABEL=]URL (repeatable).")] = None,
    config: Annotated[
        list[Path] | None,
        typer.Option(help="A serving config: `kvq serve --config FILE` is started for its turn."),
    ] = None,
    launch: Annotated[
        list[str] | None,
        typer.Option(
            help="LABEL=COMMAND: a server command with {port} in it (e.g. vLLM's `vllm serve`), started "
            "for its turn and stopped after it (repeatable).",
        ),
    ] = None,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = ",".join(
        map(str, ServeBenchConfig.concurrency)
    ),
    num_prompts: Annotated[
        int, typer.Option(help="Requests per level (at least the level).")
    ] = ServeBenchConfig.num_prompts,
    max_tokens: Annotated[
        int, typer.Option(help="Tokens each request generates.")
    ] = ServeBenchConfig.max_tokens,
    dataset: Annotated[
        Path | None, typer.Option(help=".jsonl (prompt or text field) or .txt (one prompt per line).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="KVQ_API_KEY", help="Sent as 'Authorization: Bearer KEY'.")
    ] = None,
    json_out: JsonOption = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG plot of the results.")] = None,
    server_log: Annotated[
        Path | None, typer.Option(help="Append the output of the servers kvq starts to this file.")
    ] = None,
) -> None:
    """Load OpenAI-compatible servers at several concurrency levels: tok/s, request/s, TTFT, TPOT, ITL and
    end-to-end latency (p50/p95/p99), one server at a time."""
    settings = ServeBenchConfig(parse_concurrency(concurrency), num_prompts, max_tokens)
    if num_prompts < 1 or max_tokens < 2:
        raise KvqError("--num-prompts must be >= 1 and --max-tokens >= 2 (TPOT needs two tokens)")
    specs = parse_servers(url or [], config or [], launch or [])
    prompts = load_prompts(dataset, settings)
    results = {spec.label: bench_server(spec, prompts, settings, api_key, server_log) for spec in specs}
    wide = console if console.is_terminal else Console(highlight=False, width=170)  # a log: do not wrap
    wide.print(render(results))
    if json_out is not None:
        data = {
            "config": asdict(settings),
            "servers": {k: [r.to_json() for r in v] for k, v in results.items()},
        }
        tmp = json_out.with_suffix(json_out.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(json_out)
    if plot is not None:
        plot_levels(results, plot)
