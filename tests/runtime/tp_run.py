"""One engine run for the tensor-parallel tests, in a process of its own (a --tp engine starts its ranks
and a torch.distributed group: one per process): greedy continuations, teacher-forced logits and each
rank's weight bytes. `python -m tests.runtime.tp_run CASE_JSON OUT` saves `run(**case)` to OUT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams
from tests.runtime.reference import engine_greedy, teacher_forced_logits

TIMEOUT_S = 600  # two ranks loading torch on a shared 2-core machine; a hang still ends


def run(
    model: str,
    tp: int,
    dtype: str,
    prompts: list[list[int]],
    num_tokens: int,
    forced: list[list[int]] | None = None,
) -> dict:
    """Greedy continuations of `prompts`, logits along `forced` (fp32 `[len + 1, V]` each), the last
    prompt's own log-probabilities, per-rank stored bytes read and resident bytes."""
    kv_cache_dtype = "auto" if dtype == "float32" else "bf16"
    config = EngineConfig(
        model=model, tp=tp, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_memory="4MiB", threads=1
    )
    engine = Engine(config)
    scored = engine.generate(prompts[-1:], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    result = {
        "greedy": engine_greedy(engine, prompts, num_tokens),
        "read_bytes": engine.rank_read_bytes,
        "weight_bytes": engine.rank_weight_bytes,
        "logits": [teacher_forced_logits(engine, p, f) for p, f in zip(prompts, forced or [], strict=False)],
        "prompt_logprobs": [e.logprob for e in scored.prompt_logprobs[1:]],
    }
    engine.close()
    return result


def run_in_process(out: Path, **case: object) -> dict:
    """`run(**case)` in a fresh Python process (for tp > 1)."""
    argv = [sys.executable, "-m", "tests.runtime.tp_run", json.dumps(case), str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return torch.load(out)


if __name__ == "__main__":
    torch.save(run(**json.loads(sys.argv[1])), sys.argv[2])
