"""`kvq plan`'s numbers: per module kind, tensors, parameters and bytes before and after, and the output size.

The output size is exact, not estimated: the same `CompressPlan` that `kvq compress` executes gives every
output tensor, and `shard_layout` gives each shard's header bytes as the safetensors writer will emit them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from kvq.checkpoint.module_kind import MODULE_KINDS, module_kind
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.tensor_plan import CompressPlan, KeptTensor
from kvq.inspect import logical_parameters


@dataclass
class KindSizes:
    tensors_before: int = 0
    tensors_after: int = 0
    parameters: int = 0
    bytes_before: int = 0
    bytes_after: int = 0


@dataclass
class SizePlan:
    kinds: dict[str, KindSizes]
    total: KindSizes
    source_file_bytes: int  # tensor data plus headers of the source shards (bare config: headers estimated)
    output_file_bytes: int  # every output shard file, headers included
    num_int4: int
    num_fp8_kept: int
    kept: list[KeptTensor] = field(default_factory=list)
    dequantized: list[KeptTensor] = field(default_factory=list)  # FP8-block weights written as BF16

    def to_json(self) -> dict:
        return asdict(self)


def size_plan(plan: CompressPlan, source_file_bytes: int) -> SizePlan:
    """Sum every task's inputs and outputs by module kind; lay out each output shard for its exact size."""
    kinds: dict[str, KindSizes] = defaultdict(KindSizes)
    for tasks in plan.shards.values():
        for task in tasks:
            for info in filter(None, (task.source, task.scale_inv)):
                row = kinds[module_kind(info.name)]
                row.tensors_before += 1
                row.bytes_before += info.nbytes
                row.parameters += logical_parameters(info)
            for out in task.outputs:
                row = kinds[module_kind(out.name)]
                row.tensors_after += 1
                row.bytes_after += out.nbytes
    ordered = {k: kinds[k] for k in MODULE_KINDS if k in kinds}
    total = KindSizes(*(sum(getattr(r, f) for r in ordered.values()) for f in KindSizes.__dataclass_fields__))
    return SizePlan(
        ordered,
        total,
        source_file_bytes,
        output_file_bytes(plan),
        len(plan.int4_modules),
        len(plan.fp8_modules),
        list(plan.kept),
        list(plan.dequantized),
    )


def output_file_bytes(plan: CompressPlan) -> int:
    """The bytes of every output shard `plan` writes, each laid out exactly (header included)."""
    return sum(
        shard_layout([out for task in tasks for out in task.outputs]).file_bytes
        for tasks in plan.shards.values()
    )
