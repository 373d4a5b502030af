"""`evaluate_served(model, baseline, config)`: the `kvq eval` report of models behind OpenAI-compatible
servers (vLLM, SGLang, `kvq serve`), e.g. a checkpoint too large for one machine served at TP8 beside its
baseline served the same way.

Tasks run through lm-eval's `local-completions` backend (token-id prompts, the checkpoint's tokenizer
client-side, `echo` + `logprobs` for log-likelihoods), concurrently with retries. Held-out text is scored
from vLLM's `prompt_logprobs` (`kvq.eval.server_text`). Both servers are checked before anything runs.
Imports lm_eval, transformers (the tokenizer) and kvq.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq import __version__
from kvq.eval.eval_config import EvalConfig
from kvq.eval.harness import TaskResult, run_tasks, task_manager
from kvq.eval.in_process import settings_of, text_source, text_windows, versions_of
from kvq.eval.lm import Progress, no_progress
from kvq.eval.run_report import run_entry, task_items
from kvq.eval.server_client import Server, check_server
from kvq.eval.server_text import served_window_scores


@dataclass(frozen=True)
class ClientSettings:
    """How the servers are called: the tokenizer (a local folder or Hub id of the served checkpoint's),
    requests in flight per server, retries of a failed request."""

    tokenizer: str
    num_concurrent: int = 8
    max_retries: int = 3


def evaluate_served(
    model: Server,
    baseline: Server | None,
    config: EvalConfig,
    client: ClientSettings,
    progress: Progress = no_progress,
) -> dict:
    """The report `kvq eval --server ... --json` writes: one run (the model as served)."""
    manager = task_manager(config.include_paths, config.lm_eval_tasks)
    top_n = config.top_logprobs if config.has_text else None
    servers = {"model": check_server(model, bool(config.lm_eval_tasks), top_n)}
    if baseline is not None:
        servers["baseline"] = check_server(baseline, bool(config.lm_eval_tasks), top_n)
    source = text_source(config)
    report: dict = {"kvq_version": __version__, "engine": {"name": "server", "servers": servers}}
    report |= {"settings": settings_of(config, source) | {"tokenizer": client.tokenizer}, "baseline": None}
    base_tasks = None
    if baseline is not None:
        base_tasks = _tasks(baseline, servers["baseline"], config, client, manager)
        items = {"tasks": {name: task_items(r) for name, r in base_tasks.items()}}
        report["baseline"] = _describe(baseline, servers["baseline"]) | {"items": items}
    report["model"] = _describe(model, servers["model"])
    tasks = _tasks(model, servers["model"], config, client, manager)
    text, note = None, ""
    if config.has_text:
        from transformers import AutoTokenizer

        windows = text_windows(AutoTokenizer.from_pretrained(client.tokenizer), config, source)
        advance = progress(
            f"text: {model.model}" + (f" vs {baseline.model}" if baseline else ""), len(windows)
        )
        text = served_window_scores(
            model, baseline, windows, config.top_logprobs, client.num_concurrent, advance
        )
        note = f"lower bound from the top-{config.top_logprobs} prompt log-probabilities"
    meta = {"checkpoint": "model", "path": model.model, "kv_cache_dtype": "as served"}
    meta |= {"kv_cache": "as served", "dtype": "as served"}
    report["runs"] = [run_entry(meta, tasks, base_tasks, text, note)]
    report["settings"]["task_versions"] = versions_of(report["runs"][0])
    return report


def completions_args(server: Server, info: dict, client: ClientSettings) -> dict:
    """lm-eval `local-completions` model_args for one server."""
    args = {
        "model": server.model,
        "base_url": server.completions_url,
        "tokenizer": client.tokenizer,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,
        "num_concurrent": client.num_concurrent,
        "max_retries": client.max_retries,
    }
    if info.get("max_model_len"):
        args["max_length"] = int(info["max_model_len"])
    if server.api_key:
        args["header"] = {"Authorization": f"Bearer {server.api_key}"}
    return args


def _tasks(
    server: Server, info: dict, config: EvalConfig, client: ClientSettings, manager: object
) -> dict[str, TaskResult]:
    args = completions_args(server, info, client)
    return run_tasks(
        "local-completions", config.lm_eval_tasks, manager, config.limit, config.num_fewshot, args
    )


def _describe(server: Server, info: dict) -> dict:
    """The served model as the report names it; a fingerprint when the server names a local checkpoint
    folder (vLLM's `root`), so that `kvq push` can check the report measured the folder it publishes."""
    described = {"path": server.model, "format": f"served by {info['name']}", "server": info}
    described |= {"kv_cache": "as served", "dtype": "as served"}
    root = info.get("root")
    if root and (Path(root) / "config.json").is_file():
        from kvq.checkpoint.reader import Checkpoint
        from kvq.compress.manifest import source_fingerprint

        described["fingerprint"] = source_fingerprint(Checkpoint.open(Path(root)))
    return described
