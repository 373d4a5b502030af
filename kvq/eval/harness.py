"""lm-evaluation-harness as a library for `kvq eval`: where tasks are found (kvq's task files in
`kvq/eval/tasks`, then `--include-path` folders, then lm-eval's own), the check that every named task exists,
one model's run of the tasks, and per task its lm-eval version and each metric's per-document values.

Imports lm_eval (inside functions: `kvq eval --help` and its flag checks need none of it) and kvq.errors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq.errors import KvqError

if TYPE_CHECKING:
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

LOCAL_TASKS = Path(__file__).resolve().parent / "tasks"


@dataclass
class TaskResult:
    """One model's answers to one lm-eval task: `values[metric]` per document, in doc_id order, and lm-eval's
    aggregate of each metric (`metric` is lm-eval's "name,filter", e.g. "exact_match,strict-match")."""

    task: str
    version: str
    num_fewshot: int
    doc_ids: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    aggregates: dict[str, float] = field(default_factory=dict)
    higher_is_better: dict[str, bool] = field(default_factory=dict)
    responses: list = field(default_factory=list)  # per document, the model's raw answers (lm-eval's resps)


def task_manager(include_paths: Sequence[Path], names: Sequence[str]) -> TaskManager:
    """A TaskManager that finds every task of `names`: kvq's and `include_paths`' alone when they have them
    all (no index of lm-eval's thousands of files), else lm-eval's own too. Unknown names are refused."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        if not Path(path).is_dir():
            raise KvqError(f"--include-path {path}: not a folder; give a folder of lm-eval task YAML files")
    paths = [str(LOCAL_TASKS), *(str(p) for p in include_paths)]
    local = TaskManager(include_path=paths, include_defaults=False)
    if all(name in local.all_tasks for name in names):
        return local
    manager = TaskManager(include_path=paths)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise KvqError(
            f"--tasks {','.join(unknown)}: not an lm-eval task or group; local tasks: "
            f"{', '.join(sorted(local.all_tasks))} (`lm_eval ls tasks` lists lm-eval's; --include-path DIR "
            "adds task files)"
        )
    return manager


def run_tasks(
    model: LM | str,
    names: Sequence[str],
    manager: TaskManager,
    limit: int | None,
    num_fewshot: int | None = None,
    model_args: dict | None = None,
) -> dict[str, TaskResult]:
    """Every task of `names` (groups expanded to their tasks) through lm-eval on one model: an `LM` object
    (the kvq runtime) or a backend name with its `model_args` (`local-completions`); none: nothing runs."""
    if not names:
        return {}
    import lm_eval

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(names),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=True,
        bootstrap_iters=0,
    )
    if results is None:  # only on ranks other than 0, which kvq eval never is
        raise KvqError("lm-eval returned no results")
    return {task: task_result(task, results, samples) for task, samples in results["samples"].items()}


def task_result(task: str, results: dict, samples: list[dict]) -> TaskResult:
    """Per-document values of each metric (numbers only; a metric whose per-document value is not a number,
    such as a perplexity's (log-likelihood, words) pair, keeps lm-eval's aggregate alone)."""
    found = TaskResult(
        task=task,
        version=str(results["versions"].get(task)),
        num_fewshot=int(results["n-shot"].get(task) or 0),
        higher_is_better=dict(results["higher_is_better"].get(task) or {}),
    )
    for key, value in results["results"][task].items():
        name, _, filt = key.partition(",")
        if filt and not name.endswith("_stderr") and _is_number(value):
            found.aggregates[key] = float(value)
    by_doc: dict[str, dict[int, float]] = {}
    responses: dict[int, object] = {}
    for sample in samples:
        responses.setdefault(int(sample["doc_id"]), sample.get("resps"))
        for name in sample.get("metrics", []):
            value = sample.get(name)
            if value is not None and _is_number(value):
                by_doc.setdefault(f"{name},{sample.get('filter', 'none')}", {})[int(sample["doc_id"])] = (
                    float(value)
                )
    doc_ids = sorted({doc for docs in by_doc.values() for doc in docs})
    found.doc_ids = doc_ids
    found.responses = [responses[d] for d in doc_ids]
    found.values = {
        key: [docs[d] for d in doc_ids] for key, docs in by_doc.items() if len(docs) == len(doc_ids)
    }
    return found


def _is_number(value: Any) -> bool:
    try:
        return not isinstance(value, (str, bytes, tuple, list)) and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
