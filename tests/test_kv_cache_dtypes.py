"""One dtype vocabulary for plan, generate, serve, eval and bench: vLLM's KV-cache names, and `--dtype` and
`--kv-cache-dtype` each taking the other's spellings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvq.errors import KvqError
from kvq.kv_cache_dtypes import KV_CACHE_DTYPES, check_dtype, check_kv_cache_dtype, resolve_kv_cache_dtype
from kvq.runtime.config import EngineConfig


def test_the_vocabulary_is_vllms() -> None:
    assert KV_CACHE_DTYPES == ("auto", "bf16", "fp8_e4m3")
    assert [check_kv_cache_dtype(name) for name in KV_CACHE_DTYPES] == list(KV_CACHE_DTYPES)


@pytest.mark.parametrize(
    ("spelling", "name"),
    [
        ("fp8", "fp8_e4m3"),
        ("FP8", "fp8_e4m3"),
        ("float8_e4m3fn", "fp8_e4m3"),
        ("bfloat16", "bf16"),
        ("bf16", "bf16"),
    ],
)
def test_other_spellings_give_the_name(spelling: str, name: str) -> None:
    assert check_kv_cache_dtype(spelling) == name


def test_dtype_and_kv_cache_dtype_take_each_others_spellings(tmp_path: Path) -> None:
    assert [check_dtype(v) for v in ("bf16", "bfloat16", "fp32", "float32", "auto")] == [
        "bfloat16", "bfloat16", "float32", "float32", "auto",
    ]  # fmt: skip
    config = EngineConfig(model=str(tmp_path), dtype="bf16", kv_cache_dtype="bfloat16")
    assert (config.dtype, config.kv_cache_dtype) == ("bfloat16", "bf16")
    assert EngineConfig(model=str(tmp_path), dtype="fp32").is_reference
    with pytest.raises(KvqError, match="--dtype 'fp8': use one of auto, bfloat16, float32"):
        check_dtype("fp8")


def test_unknown_names_list_the_vocabulary() -> None:
    with pytest.raises(KvqError, match="use one of auto, bf16, fp8_e4m3 \\(or bfloat16, fp8\\)"):
        check_kv_cache_dtype("int8")


def test_auto_resolves_like_the_runtime(tmp_path: Path) -> None:
    assert resolve_kv_cache_dtype("auto", has_kv_cache_scheme=True) == "fp8_e4m3"
    assert resolve_kv_cache_dtype("auto", has_kv_cache_scheme=False) == "bf16"
    assert resolve_kv_cache_dtype("bf16", has_kv_cache_scheme=True) == "bf16"
    config = EngineConfig(model=str(tmp_path))
    assert (
        config.kv_torch_dtype(True) == torch.float8_e4m3fn and config.kv_torch_dtype(False) == torch.bfloat16
    )
    assert EngineConfig(model=str(tmp_path), kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"  # vLLM's too
