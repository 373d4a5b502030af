"""lm-evaluation-harness through `kvq serve` in its serving precision: the BF16 checkpoint with bf16
activations against lm-eval's `hf` backend in bfloat16, and the INT4 + FP8 KV checkpoint (kvq compress
w4a16-linear group 64, kvq calibrate) scored through the same task.

bf16 sums differ between the two stacks (transformers' own bf16 and fp32 scores differ by up to ~0.45
nats per choice on these items), so the stated tolerance is on answers: the accuracies differ by at most
MAX_ACC_DIFF and the picked choice of at least MIN_AGREEMENT of the items is the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.clients.lm_eval_runs import MULTIPLE_CHOICE, Scored, completions_args, evaluate, hf_args
from tests.serve.conftest import running_server

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

NUM_ITEMS = 20
MAX_ACC_DIFF = 0.10  # two items of twenty
MIN_AGREEMENT = 0.85


def served_score(checkpoint: Path, tokenizer: Path, **engine: object) -> Scored:
    model = Engine(EngineConfig(model=str(checkpoint), kv_memory="64MiB", threads=2, **engine))  # type: ignore[arg-type]
    with running_server(model) as running:
        args = completions_args(running.url, tokenizer)
        return evaluate("local-completions", args, MULTIPLE_CHOICE, NUM_ITEMS)


def picked(scored: Scored) -> list[int]:
    return [max(range(len(lls)), key=lls.__getitem__) for lls in scored.loglikelihoods()]


@pytest.fixture(scope="module")
def hf_bf16(smollm2) -> Scored:
    return evaluate("hf", hf_args(smollm2.bf16, "bfloat16"), MULTIPLE_CHOICE, NUM_ITEMS)


@pytest.fixture(scope="module")
def int4_fp8_kv(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from kvq.calibrate.calibrate_checkpoint import calibrate
    from kvq.calibrate.calibration_config import CalibrationConfig
    from kvq.compress.recipe import load_recipe
    from kvq.compress.runner import prepare, run

    out = tmp_path_factory.mktemp("smollm2-int4-fp8kv") / "model"
    run(prepare(smollm2.bf16, out, load_recipe("w4a16-linear", 64)), workers=1)
    calibrate(out, CalibrationConfig(num_samples=4, seq_len=256))
    yield out


def test_bf16_serving_scores_as_hf_bf16(smollm2, hf_bf16: Scored) -> None:
    served = served_score(smollm2.bf16, smollm2.bf16)  # dtype auto: bf16 activations
    assert abs(served.score - hf_bf16.score) <= MAX_ACC_DIFF
    agreement = sum(a == b for a, b in zip(picked(served), picked(hf_bf16), strict=True)) / NUM_ITEMS
    assert agreement >= MIN_AGREEMENT


def test_int4_fp8_kv_checkpoint_gets_a_score(smollm2, int4_fp8_kv: Path, hf_bf16: Scored) -> None:
    served = served_score(int4_fp8_kv, smollm2.bf16, kv_cache_dtype="fp8_e4m3", require_kv_scales=True)
    assert len(served.samples) == NUM_ITEMS and 0.0 <= served.score <= 1.0
    assert all(len(lls) == 4 and all(ll < 0 for ll in lls) for lls in served.loglikelihoods())
    # 4-bit weights move scores, not the whole ranking: most answers stay those of the BF16 model
    agreement = sum(a == b for a, b in zip(picked(served), picked(hf_bf16), strict=True)) / NUM_ITEMS
    assert agreement >= 0.5
