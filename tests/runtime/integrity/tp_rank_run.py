"""The `--tp 2` runs of test_rank_checks. Under torchrun (`python -m torch.distributed.run --nproc-per-node 2
-m tests.runtime.integrity.tp_rank_run CASE_JSON OUT`): rank 0 generates the prompts twice and saves the
outputs to OUT; rank 1, when `flip_row` is set, flips a sampled bit of its own copy of a sealed page (in
the pool of rank 1's runner, as `FaultInjector.bit_flip` does) just before the first decode step is
checked: the page of logical index 0 of that row of the batch, recorded in OUT.rank1.json. A case
naming a drill `fault` (`python -m tests.runtime.integrity.tp_rank_run CASE_JSON OUT`, kvq starting the
ranks): `drill`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from kvq.runtime.batch import ForwardBatch, StepInputs
from kvq.runtime.config import EngineConfig
from kvq.runtime.distributed.worker import follow_under_launcher
from kvq.runtime.engine import Engine
from kvq.runtime.integrity import make_tracker
from kvq.runtime.model_runner import ModelRunner
from kvq.runtime.sampling import SamplingParams


def arm_bit_flip(row: int, record: Path) -> None:
    """On this rank (past 0): the fault, injected into the pool of the runner the rank builds: one bit of
    the first byte `full` mode samples (the same sample on every rank: it is seeded)."""
    loop = ModelRunner.loop

    def loop_with_fault(runner: ModelRunner) -> None:
        batch_of = runner.batch_of
        tracker = make_tracker(runner.config.kv_integrity, runner.kv_pool)
        assert tracker is not None and tracker.sample is not None
        offset = int(tracker.sample.offsets[0])

        def flip_then_batch(inputs: StepInputs) -> ForwardBatch:
            if not inputs.is_prefill:
                runner.batch_of = batch_of  # type: ignore[method-assign]  # one shot
                page = inputs.block_tables[row][0]
                runner.kv_pool.page_bytes_view()[0, 0, page, offset] ^= torch.tensor(
                    1 << 6, dtype=torch.uint8
                )
                pool = runner.kv_pool
                slots = pool.page_size * (pool.num_pages + 1)
                record.write_text(json.dumps({"page": page, "offset": offset, "pool": [pool.nbytes, slots]}))
            return batch_of(inputs)

        runner.batch_of = flip_then_batch  # type: ignore[method-assign]
        loop(runner)

    ModelRunner.loop = loop_with_fault  # type: ignore[method-assign]


def main(case: dict, out: Path) -> None:
    if os.environ["RANK"] == "1" and case["flip_row"] is not None:
        arm_bit_flip(case["flip_row"], out.with_suffix(".rank1.json"))
    config = EngineConfig(
        model=case["model"], tp=2, dtype="float32", kv_cache_dtype="auto", kv_memory="4MiB", threads=1,
        page_size=case["page_size"], kv_integrity=case["kv_integrity"],
    )  # fmt: skip
    follow_under_launcher(config)  # rank 1 runs rank 0's steps in here until rank 0 closes, then exits
    engine = Engine(config)
    params = SamplingParams(max_tokens=case["num_tokens"], ignore_eos=True)
    runs = [engine.generate(case["prompts"], params) for _ in range(2)]
    result = {
        "runs": [[(o.token_ids, o.finish_reason, o.error) for o in outs] for outs in runs],
        "aborts": engine.stats.integrity_aborts,
    }
    engine.close()
    torch.save(result, out)


def drill(case: dict, out: Path) -> None:
    """The drill's fault `case["fault"]` on a --tp 2 engine (ranks kvq starts), then its fault-free replay
    on another: `test_faults.assert_contained`'s promises, every rank's pages counted (fp32 logits of
    two --tp 2 runs are bit-equal for the same batches)."""
    from kvq.drill.faults import FAULTS
    from kvq.drill.workload import drill_engine, run_drill
    from tests.runtime.integrity.test_faults import assert_contained

    fault = next(f for f in FAULTS if f.name == case["fault"])
    engine = drill_engine(case["model"], fault.mode, tp=2)
    run = run_drill(engine, fault)
    engine.close()
    replay_engine = drill_engine(case["model"], "off", tp=2)
    replay = run_drill(replay_engine, departures=run.departures)
    replay_engine.close()
    assert_contained(engine, run, fault, replay)
    torch.save({"ok": True, "num_aborts": run.num_aborts}, out)


if __name__ == "__main__":
    case = json.loads(sys.argv[1])
    (drill if "fault" in case else main)(case, Path(sys.argv[2]))
