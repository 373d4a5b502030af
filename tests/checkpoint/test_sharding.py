"""Shard planning: contiguous, size-balanced, >= 3 shards, cuts between an FP8 weight and its scale."""

from __future__ import annotations

from itertools import pairwise

import torch

from kvq.checkpoint.sharding import MIN_SHARDS, shard_file_names, split_shards
from kvq.checkpoint.specs import TensorSpec


def _fp8_pair(name: str, rows: int, cols: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{name}.weight", (rows, cols), torch.float8_e4m3fn),
        TensorSpec(f"{name}.weight_scale_inv", (-(-rows // 128), -(-cols // 128)), torch.float32),
    ]


def test_small_checkpoint_still_gets_three_shards_in_order():
    specs = [TensorSpec(f"t{i}", (10,), torch.bfloat16) for i in range(7)]
    shards = split_shards(specs, max_shard_bytes=1 << 30)
    assert len(shards) == MIN_SHARDS and all(shards)
    assert [s for shard in shards for s in shard] == specs


def test_cuts_fall_between_a_weight_and_its_scale():
    specs = [TensorSpec("embed.weight", (100, 64), torch.bfloat16)]
    for i in range(9):
        specs += _fp8_pair(f"layers.{i}.proj", 200, 300)
        specs.append(TensorSpec(f"layers.{i}.norm.weight", (300,), torch.bfloat16))
    shards = split_shards(specs, max_shard_bytes=1 << 30)
    assert [s for shard in shards for s in shard] == specs
    for before, after in pairwise(shards):
        assert before[-1].name.endswith(".weight") and after[0].name == before[-1].name + "_scale_inv"


def test_many_shards_when_large():
    specs = [TensorSpec(f"t{i}", (1024, 1024), torch.bfloat16) for i in range(10)]  # 2 MiB each
    shards = split_shards(specs, max_shard_bytes=5 << 20)
    assert len(shards) == 4 and max(sum(1 for _ in s) for s in shards) <= 3
    assert shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
