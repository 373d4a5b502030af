"""Split a checkpoint's tensors into shards the way real multi-file checkpoints end up.

Tensors keep their module order and are cut into contiguous, size-balanced shards; every cut that
follows an FP8 `weight` is moved to fall between that weight and its `weight_scale_inv`, so readers
that assume a scale sits next to its weight fail on fixtures as they would on DeepSeek-V3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

from kvq.checkpoint.specs import TensorSpec

MIN_SHARDS = 3


def spec_nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * spec.dtype.itemsize


def shard_file_names(num_shards: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def split_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """At least `MIN_SHARDS` non-empty contiguous shards of about `total / n` bytes each."""
    total = sum(spec_nbytes(s) for s in specs)
    num_shards = max(MIN_SHARDS, math.ceil(total / max_shard_bytes))
    assert len(specs) >= num_shards, f"{len(specs)} tensors cannot fill {num_shards} shards"
    starts, offset = [], 0
    for spec in specs:
        starts.append(offset)
        offset += spec_nbytes(spec)
    cuts = [0]
    for k in range(1, num_shards):
        cut = next((i for i, start in enumerate(starts) if start >= k * total / num_shards), len(specs))
        cut = _between_weight_and_scale(specs, cuts[-1], cut)
        cuts.append(min(max(cut, cuts[-1] + 1), len(specs) - (num_shards - k)))
    cuts.append(len(specs))
    return [list(specs[a:b]) for a, b in pairwise(cuts)]


def _between_weight_and_scale(specs: Sequence[TensorSpec], lo: int, cut: int) -> int:
    """Move `cut` back to just after the last FP8 weight in `specs[lo:cut]` whose scale follows it."""
    for i in range(min(cut, len(specs) - 1), lo, -1):
        if _is_scale_of(specs[i], specs[i - 1]):
            return i
    return cut


def _is_scale_of(scale: TensorSpec, weight: TensorSpec) -> bool:
    return scale.name.endswith(".weight_scale_inv") and weight.name == scale.name.removesuffix("_scale_inv")
