"""One KV-cache dtype vocabulary (vLLM's) for plan, generate, serve, eval and bench; old names say the new."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.errors import KvqError
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_kv_cache_dtype, resolve_kv_cache_dtype
from kvq.runtime.config import EngineConfig


def test_the_vocabulary_is_vllms() -> None:
    assert KV_CACHE_DTYPES == ("auto", "bf16", "fp8_e4m3")
    assert [check_kv_cache_dtype(name) for name in KV_CACHE_DTYPES] == list(KV_CACHE_DTYPES)


@pytest.mark.parametrize(
    ("old", "new"),
    [("fp8", "fp8_e4m3"), ("FP8", "fp8_e4m3"), ("float8_e4m3fn", "fp8_e4m3"), ("bfloat16", "bf16")],
)
def test_old_spellings_name_the_new_one(old: str, new: str) -> None:
    with pytest.raises(KvqError, match=f"^--kv-cache-dtype '{old}': the name is now '{new}'"):
        check_kv_cache_dtype(old)


def test_unknown_names_list_the_vocabulary() -> None:
    with pytest.raises(KvqError, match="use one of auto, bf16, fp8_e4m3"):
        check_kv_cache_dtype("int8")


def test_auto_resolves_like_the_runtime(tmp_path: Path) -> None:
    assert resolve_kv_cache_dtype("auto", has_kv_cache_scheme=True) == "fp8_e4m3"
    assert resolve_kv_cache_dtype("auto", has_kv_cache_scheme=False) == "bf16"
    assert resolve_kv_cache_dtype("bf16", has_kv_cache_scheme=True) == "bf16"
    config = EngineConfig(model=str(tmp_path))
    assert (
        config.kv_torch_dtype(True) == torch.float8_e4m3fn and config.kv_torch_dtype(False) == torch.bfloat16
    )
    with pytest.raises(KvqError, match="--kv-cache-dtype 'fp8': the name is now 'fp8_e4m3'"):
        EngineConfig(model=str(tmp_path), kv_cache_dtype="fp8")
