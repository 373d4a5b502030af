"""Decide from tensor names, dtypes and shapes alone what every stored tensor becomes; validate it up front.

Per stored tensor: `int4` (a targeted Linear weight -> `weight_packed` + `weight_scale` + `weight_shape`),
`fp8-block` (an FP8-block weight kept as FP8 -> compressed-tensors `weight` + block `weight_scale`),
`dequantize` (an FP8-block weight written as BF16, exactly as compressed-tensors' FP8BlockDequantizer
computes it), or `copy` (bytes unchanged). Which FP8 weights are dequantized depends on the serving
target (`TARGETS`): `sglang` dequantizes every FP8 weight it does not quantize (SGLang main loads no FP8
block weights beside INT4 experts); `vllm` only those whose input dimension is not a multiple of the
block, which compressed-tensors' dynamic per-group activation quantization cannot run, and the parts of a
fused layer (q/k/v, gate/up, q_a/kv_a) whose outputs but the last are not whole blocks, which vLLM's
`validate_fp8_block_shape` refuses for a merged GEMM (the parts go together). `weight_scale_inv`
tensors are consumed by their weight wherever they are stored. Each task lands in the output shard named
like its weight's source shard. Pure: no tensor data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvq.checkpoint.dtypes import FLOAT_CODES, itemsize
from kvq.checkpoint.fused_layers import fused_layer
from kvq.checkpoint.header import TensorInfo
from kvq.compress.recipe import Recipe
from kvq.errors import KvqError
from kvq.formats.shapes import PACK_FACTOR, scale_inv_shape

INT4, FP8_BLOCK, DEQUANTIZE, COPY = "int4", "fp8-block", "dequantize", "copy"
VLLM, SGLANG = "vllm", "sglang"
TARGETS = (VLLM, SGLANG)  # the layouts `kvq compress --target` writes; vllm first: the default
_EMBEDDING_MODULES = ("embed_tokens", "wte", "word_embeddings")
_COMPRESSED_SUFFIXES = ("weight_packed", "weight_shape", "weight_zero_point")


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of an output shard: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorTask:
    """One stored tensor (with its FP8 `weight_scale_inv`, wherever stored) and the tensors it becomes."""

    action: str
    source: TensorInfo
    scale_inv: TensorInfo | None
    outputs: tuple[OutputTensor, ...]

    @property
    def module(self) -> str:
        return self.source.name.rpartition(".")[0]

    @property
    def input_bytes(self) -> int:
        return self.source.nbytes + (self.scale_inv.nbytes if self.scale_inv else 0)


@dataclass(frozen=True)
class KeptTensor:
    """A weight not written as INT4, or an FP8 one written as BF16, and why."""

    name: str
    shape: tuple[int, ...]
    reason: str


@dataclass
class CompressPlan:
    """Every task, grouped by output shard, and the module lists the output config.json needs."""

    group_size: int
    block: tuple[int, int]
    target: str = VLLM
    shards: dict[str, list[TensorTask]] = field(default_factory=dict)
    kept: list[KeptTensor] = field(default_factory=list)  # targeted Linears left at source precision
    dequantized: list[KeptTensor] = field(default_factory=list)  # FP8-block weights written as BF16
    int4_modules: list[str] = field(default_factory=list)
    fp8_modules: list[str] = field(default_factory=list)
    dense_linear_modules: list[str] = field(default_factory=list)
    has_lm_head: bool = True
    misaligned_fused: frozenset[str] = frozenset()  # FP8 parts of fused layers with partial output blocks

    @property
    def tasks(self) -> list[TensorTask]:
        return [task for tasks in self.shards.values() for task in tasks]


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D `.weight` of a Linear: not a norm (compressed-tensors' rule) and not a token embedding."""
    module, _, param = name.rpartition(".")
    leaf = module.rpartition(".")[2]
    return (
        param == "weight"
        and len(shape) == 2
        and not module.endswith("norm")
        and leaf not in _EMBEDDING_MODULES
    )


def build_plan(
    tensors: Mapping[str, TensorInfo],
    recipe: Recipe,
    block: tuple[int, int],
    target: str = VLLM,
    weight_prefix: str = "",
) -> CompressPlan:
    """Plan the whole job for a serving `target`; raise `KvqError` naming the tensor for anything that
    cannot be compressed.

    Only the language model (tensors under `weight_prefix`, e.g. Kimi K2.5's `language_model.`) is
    quantized; a multimodal wrapper's vision tower and projector are kept at source precision.
    """
    if target not in TARGETS:
        raise KvqError(f"--target {target!r} is not known; use one of {', '.join(TARGETS)}")
    plan = CompressPlan(
        recipe.group_size, block, target, has_lm_head=f"{weight_prefix}lm_head.weight" in tensors
    )
    plan.misaligned_fused = _misaligned_fused(tensors, block)
    consumed: set[str] = set()
    for name in sorted(tensors):
        info = tensors[name]
        if name.endswith(".weight_scale_inv") or name.rpartition(".")[2] in _COMPRESSED_SUFFIXES:
            _check_not_compressed(info)
            continue
        hf_module = (
            name.rpartition(".")[0].removeprefix(weight_prefix) if name.startswith(weight_prefix) else None
        )
        task = _task(info, tensors, recipe, block, plan, hf_module)
        if task.scale_inv is not None:
            consumed.add(task.scale_inv.name)
        plan.shards.setdefault(info.file.name, []).append(task)
    orphans = sorted(n for n in tensors if n.endswith(".weight_scale_inv") and n not in consumed)
    if orphans:
        info = tensors[orphans[0]]
        raise KvqError(
            f"{info.file}: {orphans[0]!r} has no FP8 weight {orphans[0].removesuffix('_scale_inv')!r} "
            f"({len(orphans)} such scale(s)); the checkpoint is incomplete: restore the missing shard"
        )
    for tasks in plan.shards.values():
        tasks.sort(key=lambda t: (t.source.file.name, t.source.start))  # sequential reads within a shard
    return plan


def _check_not_compressed(info: TensorInfo) -> None:
    """weight_packed / weight_shape / an FP8 weight's weight_scale: a compressed-tensors checkpoint."""
    if not info.name.endswith(".weight_scale_inv"):
        raise KvqError(
            f"{info.file}: tensor {info.name!r} is already compressed-tensors output; kvq compress "
            "takes BF16/FP16/FP32 or FP8-block checkpoints: pass the original source"
        )


def _task(
    info: TensorInfo,
    tensors: Mapping[str, TensorInfo],
    recipe: Recipe,
    block: tuple[int, int],
    plan: CompressPlan,
    hf_module: str | None,  # the module's name without the language-model prefix; None outside it
) -> TensorTask:
    module = info.name.rpartition(".")[0]
    is_linear = is_linear_weight(info.name, info.shape)
    if info.dtype == "F8_E4M3":
        scale_inv = _scale_inv(info, tensors, block)
    elif info.dtype.startswith("F8_"):
        raise KvqError(
            f"{info.file}: tensor {info.name!r} is {info.dtype}; kvq reads FP8 e4m3 (F8_E4M3) "
            "block checkpoints only"
        )
    else:
        scale_inv = None
    if not is_linear:
        if scale_inv is not None:
            raise KvqError(
                f"{info.file}: FP8 tensor {info.name!r} {list(info.shape)} is not a 2-D Linear weight; "
                "kvq cannot dequantize it"
            )
        return TensorTask(COPY, info, None, (OutputTensor(info.name, info.dtype, info.shape),))
    is_float = scale_inv is not None or info.dtype in FLOAT_CODES
    if is_float and hf_module is not None and recipe.matches(module, hf_module):
        if info.shape[1] % recipe.group_size == 0:
            plan.int4_modules.append(module)
            return _int4_task(info, scale_inv, recipe.group_size)
        plan.kept.append(
            KeptTensor(
                info.name,
                info.shape,
                f"in_features {info.shape[1]} is not a multiple of group_size {recipe.group_size}",
            )
        )
    if scale_inv is not None:
        reason = _dequantize_reason(info.shape, block, plan.target, module in plan.misaligned_fused)
        if reason:
            plan.dequantized.append(KeptTensor(info.name, info.shape, reason))
            plan.dense_linear_modules.append(module)
            return TensorTask(DEQUANTIZE, info, scale_inv, (OutputTensor(info.name, "BF16", info.shape),))
        plan.fp8_modules.append(module)
        return TensorTask(
            FP8_BLOCK,
            info,
            scale_inv,
            (
                OutputTensor(info.name, "F8_E4M3", info.shape),
                OutputTensor(f"{module}.weight_scale", "F32", scale_inv.shape),
            ),
        )
    plan.dense_linear_modules.append(module)
    return TensorTask(COPY, info, None, (OutputTensor(info.name, info.dtype, info.shape),))


def _dequantize_reason(
    shape: tuple[int, ...], block: tuple[int, int], target: str, is_misaligned_fused: bool
) -> str | None:
    """Why an FP8-block weight kept out of INT4 is written as BF16 for `target`, or None to keep it FP8."""
    if target == SGLANG:
        return "target sglang: SGLang main does not load FP8-block Linears beside INT4 experts"
    if shape[1] % block[1]:
        return (
            f"in_features {shape[1]} is not a multiple of the {block[1]} FP8 block: dynamic per-group "
            "activation quantization cannot run it"
        )
    if is_misaligned_fused:
        return (
            f"part of a fused layer whose outputs are not whole {block[0]}-row FP8 blocks: vLLM's "
            "validate_fp8_block_shape refuses the merged GEMM"
        )
    return None


def _misaligned_fused(tensors: Mapping[str, TensorInfo], block: tuple[int, int]) -> frozenset[str]:
    """Stored FP8 Linears of fused layers in which a part other than the last has out % block rows."""
    fp8 = {
        n.removesuffix(".weight")
        for n, i in tensors.items()
        if i.dtype == "F8_E4M3" and n.endswith(".weight")
    }
    out: set[str] = set()
    for module in fp8:
        _, parts = fused_layer(module, fp8)
        if any(tensors[f"{p}.weight"].shape[0] % block[0] for p in parts[:-1]):
            out.update(parts)
    return frozenset(out)


def _int4_task(info: TensorInfo, scale_inv: TensorInfo | None, group_size: int) -> TensorTask:
    rows, cols = info.shape
    module = info.name.rpartition(".")[0]
    scale_dtype = (
        "BF16" if scale_inv is not None else info.dtype
    )  # FP8 is dequantized to bf16, as llm-compressor does
    outputs = (
        OutputTensor(f"{module}.weight_packed", "I32", (rows, cols // PACK_FACTOR)),
        OutputTensor(f"{module}.weight_scale", scale_dtype, (rows, cols // group_size)),
        OutputTensor(f"{module}.weight_shape", "I64", (2,)),
    )
    return TensorTask(INT4, info, scale_inv, outputs)


def _scale_inv(info: TensorInfo, tensors: Mapping[str, TensorInfo], block: tuple[int, int]) -> TensorInfo:
    name = f"{info.name}_scale_inv"
    scale = tensors.get(name)
    if scale is None and f"{info.name}_scale" in tensors:
        _check_not_compressed(tensors[f"{info.name}_scale"])
    if scale is None:
        raise KvqError(
            f"{info.file}: FP8 tensor {info.name!r} has no {name!r} in the checkpoint (all shards "
            "and the index searched); restore the shard that holds it or re-download the model"
        )
    if len(info.shape) != 2:
        raise KvqError(
            f"{info.file}: FP8 tensor {info.name!r} has shape {list(info.shape)}; FP8-block weights "
            "must be 2-D"
        )
    expected = scale_inv_shape(info.shape, block)
    if scale.shape != expected:
        raise KvqError(
            f"{scale.file}: {name!r} has shape {list(scale.shape)}, expected {list(expected)} for "
            f"weight {list(info.shape)} with {block[0]}x{block[1]} blocks; the shard is corrupt or "
            f"config.json quantization_config.weight_block_size is wrong"
        )
    if scale.dtype not in FLOAT_CODES:
        raise KvqError(
            f"{scale.file}: {name!r} has dtype {scale.dtype}; a weight_scale_inv must be floating point"
        )
    return scale


def virtual_tensors(
    specs: list[tuple[str, str, tuple[int, ...]]], shard: str = "model.safetensors"
) -> dict[str, TensorInfo]:
    """`TensorInfo`s for tensors that exist only on paper (a bare config.json), laid out in one shard."""
    out: dict[str, TensorInfo] = {}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * itemsize(dtype)
        out[name] = TensorInfo(name, Path(shard), dtype, tuple(shape), offset, offset + nbytes)
        offset += nbytes
    return out
