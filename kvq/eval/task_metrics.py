"""lm-eval task results -> the metric records of a `kvq eval` report (the records `kvq.eval.metrics` makes
for the text metrics, plus the task's name, lm-eval version and metric): the model's value with its 95%
interval and, with the baseline's results on the same documents, the paired delta and its interval.

Binary per-document values (acc, exact_match) get Wilson intervals, others a normal interval of the mean;
a metric lm-eval does not aggregate by the mean keeps lm-eval's value alone. Pure functions; imports
kvq.eval.harness (types) and kvq.eval.intervals.
"""

from __future__ import annotations

import math

from kvq.eval.harness import TaskResult
from kvq.eval.intervals import mean_interval, paired_interval, wilson


def task_records(model: TaskResult, baseline: TaskResult | None) -> list[dict]:
    """One record per metric (and filter) of the task, in lm-eval's order."""
    return [_record(model, baseline, metric) for metric in model.aggregates]


def metric_label(task: str, metric: str, version: str) -> str:
    """e.g. "gsm_symbolic exact_match (strict-match) v3.0"."""
    name, _, filt = metric.partition(",")
    return f"{task} {name}" + (f" ({filt})" if filt and filt != "none" else "") + f" v{version}"


def _record(model: TaskResult, baseline: TaskResult | None, metric: str) -> dict:
    record: dict = {
        "key": f"{model.task}/{metric}",
        "task": model.task,
        "version": model.version,
        "num_fewshot": model.num_fewshot,
        "metric": metric,
        "name": metric_label(model.task, metric, model.version),
        "higher_is_better": model.higher_is_better.get(metric.partition(",")[0]),
    }
    values = model.values.get(metric)
    aggregate = model.aggregates[metric]
    if not values or not math.isclose(math.fsum(values) / len(values), aggregate, abs_tol=1e-9):
        base = None if baseline is None else baseline.aggregates.get(metric)
        record |= {"unit": "score", "num_items": len(model.doc_ids), "model": aggregate, "model_ci95": None}
        if base is not None:
            record |= {"baseline": base, "delta": aggregate - base, "ci95": None}
        return record
    is_binary = all(v in (0.0, 1.0) for v in values)
    record |= {"unit": "fraction" if is_binary or all(0 <= v <= 1 for v in values) else "score"}
    record |= {"num_items": len(values), "model": aggregate, "model_ci95": _interval(values, is_binary)}
    if baseline is not None and metric in baseline.values:
        record |= _paired(model, baseline, metric)
    return record


def _interval(values: list[float], is_binary: bool) -> list[float]:
    if is_binary:
        return list(wilson(int(sum(values)), len(values)))
    _mean, low, high = mean_interval(values)
    return [low, high]


def _paired(model: TaskResult, baseline: TaskResult, metric: str) -> dict:
    """The delta over the documents both answered (the same ones, when both ran with the same limit)."""
    base = dict(zip(baseline.doc_ids, baseline.values[metric], strict=True))
    mine = dict(zip(model.doc_ids, model.values[metric], strict=True))
    shared = [d for d in model.doc_ids if d in base]
    delta, low, high = paired_interval([base[d] for d in shared], [mine[d] for d in shared])
    return {
        "baseline": math.fsum(base[d] for d in shared) / len(shared),
        "delta": delta,
        "ci95": [low, high],
        "num_paired": len(shared),
    }
