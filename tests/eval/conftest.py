"""lm-eval and datasets read local files only in these tests (read when they are first imported)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.runtime.conftest import smollm2_int4, smollm2_int4_calibrated  # noqa: E402, F401 - shared fixtures
