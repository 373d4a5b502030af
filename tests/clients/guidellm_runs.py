"""GuideLLM (`guidellm run`, its CLI in a child process) against a served model, and what its JSON report
says: request totals and per-request token counts. Default request shape: chat completions, streaming,
with vLLM's `stream_options.continuous_usage_stats`, `ignore_eos` and `max_completion_tokens`.
Imports nothing of GuideLLM: the report is read as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Load:
    """A bounded concurrent run of synthetic prompts."""

    streams: int
    prompt_tokens: int
    output_tokens: int
    max_requests: int | None = None
    max_seconds: float | None = None


def guidellm_command(url: str, model: str, tokenizer: Path, load: Load, report: Path) -> list[str]:
    """The `guidellm run` command line (also what README and BENCHMARKS.md show)."""
    data = f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}"
    limits = []
    if load.max_requests is not None:
        limits += ["--constraint", f"kind=max_requests,count={load.max_requests}"]
    if load.max_seconds is not None:
        limits += ["--constraint", f"kind=max_duration,seconds={load.max_seconds}"]
    return [
        "guidellm", "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--profile", f"kind=concurrent,streams={load.streams}",
        *limits,
        "--data", data,
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={report}",
        "--disable-progress",
    ]  # fmt: skip


def run_guidellm(command: list[str], timeout_s: float) -> dict:
    """Run it (this interpreter's guidellm, offline) and return the first benchmark of its JSON report."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", "guidellm", *command[1:]]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = Path(command[command.index("--output") + 1].split("path=", 1)[1])
    return json.loads(report.read_text())["benchmarks"][0]


def request_errors(benchmark: dict) -> list[str]:
    return [r.get("error") or "" for r in benchmark["requests"]["errored"]]
