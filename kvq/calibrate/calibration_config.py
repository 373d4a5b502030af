"""The settings of one calibration run: the single source of every default the CLI shows.

Imports only the standard library and kvq.errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError

STRATEGIES = ("tensor", "attn_head")
DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class CalibrationConfig:
    """What to observe and on which text.

    `dataset` None means the Wikipedia articles bundled in gensim (their calibration split); a file is
    used whole. `dtype` is the activation dtype of the layer forward (servers run bf16).
    """

    dataset: Path | None = None
    num_samples: int = 128
    seq_len: int = 2048
    strategy: str = "tensor"
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise KvqError(f"--num-samples must be at least 1, got {self.num_samples}")
        if self.seq_len < 2:
            raise KvqError(f"--seq-len must be at least 2 tokens, got {self.seq_len}")
        if self.strategy not in STRATEGIES:
            raise KvqError(f"--strategy {self.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")
        if self.dtype not in DTYPES:
            raise KvqError(f"dtype {self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")

    @property
    def split(self) -> str:
        """The text split calibration reads: held-out documents stay out of the default corpus."""
        return "calibration" if self.dataset is None else "all"
