"""What `kvq eval` measures: one flat dataclass, validated on creation, whose defaults the CLI reads.

Imports kvq.errors, kvq.kv_cache_dtypes and kvq.eval.gsm (its lm-eval constants) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError
from kvq.eval.gsm import MAX_GEN_TOKS
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_kv_cache_dtype

TASKS = ("text", "mmlu", "gsm")
GSM8K_TEST_SIZE = 1319  # what "every problem" means for a generated set: GSM8K's test split


@dataclass(frozen=True)
class EvalConfig:
    """tasks: held-out text (perplexity; with a baseline also KL and top-1 agreement), MMLU, GSM.
    kv_cache_dtypes: the model runs once per entry (and the baseline once more with fp8_e4m3 when it has
      calibrated scales: FP8 KV alone); the reference run of the baseline keeps K/V unquantized.
    limit: MMLU items per shot setting and GSM problems (None: every MMLU item, and as many GSM problems
      as GSM8K's test split); gsm_limit overrides it for GSM.
    subjects: MMLU subjects (lm-eval names, e.g. high_school_physics); empty: all 57.
    """

    tasks: tuple[str, ...] = TASKS
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    num_windows: int = 16
    seq_len: int = 256
    text: Path | None = None
    limit: int | None = 100
    gsm_limit: int | None = None
    subjects: tuple[str, ...] = ()
    mmlu_shots: tuple[int, ...] = (0, 5)
    gsm_shots: int = 5
    gsm_seed: int = 0
    gsm_max_tokens: int = MAX_GEN_TOKS

    def __post_init__(self) -> None:
        for value in self.kv_cache_dtypes:
            check_kv_cache_dtype(value)  # an old spelling (fp8, bfloat16) gets the name to use
        for name, values, allowed in (
            ("--tasks", self.tasks, TASKS),
            ("--kv-cache-dtype", self.kv_cache_dtypes, KV_CACHE_DTYPES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad or not values or len(set(values)) != len(values):
                raise KvqError(
                    f"{name} {','.join(values)}: expected distinct values from {', '.join(allowed)}"
                )
        if self.seq_len < 2 or self.num_windows < 1:
            raise KvqError(
                f"--seq-len must be >= 2 and --num-windows >= 1 (got {self.seq_len}, {self.num_windows})"
            )
        for flag, count in (("--limit", self.limit), ("--gsm-limit", self.gsm_limit)):
            if count is not None and count < 1:
                raise KvqError(f"{flag} must be >= 1, got {count}")
        if not self.mmlu_shots or any(not 0 <= k <= 5 for k in self.mmlu_shots):
            raise KvqError(f"--mmlu-shots {self.mmlu_shots}: MMLU has 5 dev items per subject; use 0..5")
        if self.gsm_shots < 0 or self.gsm_max_tokens < 1:
            raise KvqError(
                f"--gsm-shots must be >= 0 and --gsm-max-tokens >= 1 "
                f"(got {self.gsm_shots}, {self.gsm_max_tokens})"
            )

    @property
    def num_gsm_problems(self) -> int:
        return self.gsm_limit or self.limit or GSM8K_TEST_SIZE
