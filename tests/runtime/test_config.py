"""EngineConfig: validation on creation (byte sizes included), the KV dtype choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "fp16"}, "--dtype 'fp16': use one of auto, bfloat16, float32"),
        ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype 'int8'"),
        ({"page_size": 0}, "--page-size must be >= 1, got 0"),
        ({"kv_memory": "many"}, "--kv-memory: 'many' is not a size"),
        ({"decode_reserve_ratio": 2.0}, "decode_reserve_ratio"),
        ({"fp8_weights": "fp4"}, "--fp8-weights 'fp4'"),
        ({"lm_head_weights": "int2"}, "--lm-head-weights 'int2': pick one of auto, stored, int8, int4"),
        ({"lm_head_weights": "int4", "dtype": "float32"}, "reference mode"),
        ({"max_model_len": 1}, "--max-model-len must be >= 2 tokens, got 1"),
        ({"int4_compute": "w8a8"}, "--int4-compute 'w8a8': pick one of w4a16, w4a8"),
    ],
)
def test_bad_settings_are_user_errors(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(KvqError, match=message):
        EngineConfig(model=str(tmp_path), **kwargs)


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(KvqError, match="no such model directory"):
        EngineConfig(model=str(tmp_path / "nope"))


def test_kv_dtype_auto_follows_the_checkpoint(tmp_path: Path) -> None:
    config = EngineConfig(model=str(tmp_path))
    assert config.kv_torch_dtype(has_kv_cache_scheme=True) == torch.float8_e4m3fn
    assert config.kv_torch_dtype(has_kv_cache_scheme=False) == torch.bfloat16
    reference = EngineConfig(model=str(tmp_path), dtype="float32")
    assert reference.is_reference and reference.kv_torch_dtype(False) == torch.float32
    assert EngineConfig(model=str(tmp_path), kv_cache_dtype="bf16").kv_torch_dtype(True) == torch.bfloat16
