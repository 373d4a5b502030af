"""One run's entry of a `kvq eval` report, whatever computed it (the kvq runtime or a server): the text
metrics and every task's metric records, plus the per-item values they came from.

Pure functions over `WindowScores` and `TaskResult`s; imports kvq.eval only.
"""

from __future__ import annotations

from dataclasses import asdict

from kvq.eval import metrics
from kvq.eval.harness import TaskResult
from kvq.eval.task_metrics import task_records
from kvq.eval.text import WindowScores


def run_entry(
    meta: dict,
    tasks: dict[str, TaskResult],
    baseline_tasks: dict[str, TaskResult] | None,
    text: WindowScores | None,
    kl_note: str = "",
) -> dict:
    """`meta` (checkpoint, path, kv_cache_dtype, kv_cache, dtype) with `metrics` and `items` added;
    `kl_note` qualifies the KL row (through a server: a lower bound from the top-N log-probabilities)."""
    found: list[dict] = []
    items: dict = {}
    if text is not None:
        found += text_records(text, kl_note)
        items["text"] = asdict(text)
    for name, result in tasks.items():
        found += task_records(result, None if baseline_tasks is None else baseline_tasks.get(name))
    items["tasks"] = {name: task_items(result) for name, result in tasks.items()}
    return {**meta, "metrics": found, "items": items}


def text_records(text: WindowScores, kl_note: str = "") -> list[dict]:
    records = [metrics.perplexity(text.nll, text.reference_nll or None, text.num_predicted)]
    if text.reference_nll:
        kl = metrics.kl_divergence(text.kl, text.num_predicted)
        if kl_note:
            kl |= {"name": f"{kl['name']}, {kl_note}", "note": kl_note}
        records += [kl, metrics.top1_agreement(text.num_agree, text.num_predicted)]
    return records


def task_items(result: TaskResult) -> dict:
    return {
        "version": result.version,
        "num_fewshot": result.num_fewshot,
        "doc_ids": result.doc_ids,
        "values": result.values,
    }
