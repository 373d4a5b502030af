"""Linear layers over weights kept in their stored form: dense, FP8 block (float-quantized) or INT4 packed,
and the runtime INT4 / INT8 copies of a dense weight (the lm_head's `lm_head_weights`).

Built by the loader from `StoredLinear` records; INT4 and INT8 matmuls go through `kvq.runtime.kernels`.
Imports torch, kvq.formats/kvq.checkpoint (FP8 dequantization) and kvq.runtime.kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from kvq.checkpoint.dense import dequantize_float_quantized
from kvq.formats.pack_quantized import dequantize_pack_quantized, quantize_pack_int4
from kvq.runtime.kernels import W4A16Weight, prepare_w4a16, w4a16_linear, w4a16_linear_of
from kvq.runtime.kernels.cpu.dense import DENSE_AMX_MAX_ROWS, dense_amx_applies, dense_amx_matmul
from kvq.runtime.kernels.cpu.isa import NATIVE_ISAS, Call
from kvq.runtime.kernels.cpu.linear import gemm_dense_call, gemv_dense, gemv_dense_call
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.cpu.w4a8 import NativeW8A8, w4a8_path, w8a8_chunk
from kvq.runtime.kernels.cpu.w8a16 import W8A16Weight, prepare_w8a16, quantize_int8_rows, w8a16_linear

DENSE, FP8, INT4 = "dense", "fp8", "int4"


@dataclass
class StoredLinear:
    """One Linear as the checkpoint stores it (before it is made ready to run).

    dense: `weight` [N, K]; fp8: `weight` float8 [N, K] + `weight_scale` (block / channel / tensor) and
    `block`; int4: `weight_packed` int32 [N, K/8] + `weight_scale` [N, K/G] and `group_size`.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    block: tuple[int, int] = (128, 128)
    group_size: int = 0
    bias: torch.Tensor | None = None
    names: list[str] = field(default_factory=list)  # checkpoint names, for error messages

    @property
    def out_features(self) -> int:
        return self.tensors["weight_packed" if self.kind == INT4 else "weight"].shape[0]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The real-valued weight `[N, K]` in `dtype` (dequantized in fp32 first)."""
        t = self.tensors
        if self.kind == INT4:
            return dequantize_pack_quantized(t["weight_packed"], t["weight_scale"], dtype=dtype)
        if self.kind == FP8:
            return dequantize_float_quantized(t["weight"], t["weight_scale"], self.block, dtype)
        return t["weight"].to(dtype)


class Linear:
    """y = x @ W^T + b for x `[T, K]`; subclasses hold W in one form."""

    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y + self.bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def call(self, x: torch.Tensor, y: torch.Tensor) -> Call | None:
        """`self(x)` as one C call into y, for contiguous bf16 x `[M, K]` and y `[M, N]` (a decode plan's
        buffers, `kvq.runtime.decode_plan`), or None where `self(x)` takes another route."""
        return None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this layer keeps resident (for memory accounting)."""
        raise NotImplementedError


class DenseLinear(Linear):
    """A dense weight. On CPU in bf16: where the CPU path is amx, up to `DENSE_AMX_MAX_ROWS` bf16 rows
    (decode) through kvq's AMX GEMM straight from the weight (`dense_amx_matmul`); elsewhere, on a native
    path, one row through kvq's GEMV (`gemv_dense`; on the torch path, F.linear); other batches through
    oneDNN on a copy of the weight blocked for it once, at the first such batch (`prepack_cpu_bf16`), not
    at every call; resident from then on (`tensors` counts it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops: CpuOps) -> None:
        self.weight, self.bias = weight, bias  # [N, K]
        self.is_cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        self.packable = self.is_cpu_bf16 and onednn_prepack_available()
        self.packed: torch.Tensor | None = None  # oneDNN's blocked copy, made at the first batch
        self.is_amx = dense_amx_applies(weight, ops.isa)  # a contiguous bf16 CPU weight on the amx path
        # one row: kvq's GEMV on a native path (a contiguous bf16 CPU weight)
        self.gemv_isa = (
            ops.isa if self.is_cpu_bf16 and weight.is_contiguous() and ops.isa in NATIVE_ISAS else None
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_amx and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= DENSE_AMX_MAX_ROWS:
            return dense_amx_matmul(x, self.weight)
        if self.gemv_isa is not None and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] == 1:
            return gemv_dense(self.gemv_isa, x, self.weight)
        if not self.packable or x.numel() == x.shape[-1]:  # one row on the torch path: no blocked copy
            return F.linear(x, self.weight)
        if self.packed is None:
            self.packed = prepack_cpu_bf16(self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def call(self, x: torch.Tensor, y: torch.Tensor) -> Call | None:
        if self.bias is not None:
            return None
        if self.is_amx and x.shape[0] <= DENSE_AMX_MAX_ROWS:
            return gemm_dense_call(x, self.weight, y)  # dense_amx_matmul's
        if self.gemv_isa is not None and x.shape[0] == 1:
            return gemv_dense_call(self.gemv_isa, x, self.weight, y)
        return None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.packed, self.bias) if t is not None]


@cache
def onednn_prepack_available() -> bool:
    """Whether this torch has oneDNN, the ops that block a linear weight once (`prepack_cpu_bf16`), and
    oneDNN's bf16 path on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, within $ONEDNN_MAX_CPU_ISA): on an
    AVX2-only machine the blocking op raises, so batches there take F.linear."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported")
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def prepack_cpu_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a bf16 CPU weight `[N, K]` for `mkldnn._linear_pointwise` (what torch's
    own compiler passes make for CPU linears), or None where this torch has no oneDNN. F.linear of a
    plain weight re-blocks the whole weight at every call: SmolLM2's Linears at 8 rows ran 1.5-2x
    slower that way (BENCHMARKS, stop 27). The results are F.linear's, bit for bit (tested)."""
    if not onednn_prepack_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


class Fp8Linear(Linear):
    """FP8 weight dequantized to the activation dtype at every call: memory as stored, slower."""

    def __init__(self, stored: StoredLinear, bias: torch.Tensor | None, ops: CpuOps) -> None:
        self.stored, self.bias = stored, bias
        self.gemv_isa = ops.isa if ops.isa in NATIVE_ISAS else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.stored.dense(x.dtype)
        is_row = (
            x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and weight.device.type == "cpu"
        )
        if is_row and self.gemv_isa is not None:
            return gemv_dense(self.gemv_isa, x, weight)  # as DenseLinear: no oneDNN weight copy per call
        return F.linear(x, weight)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.stored.tensors.values(), *([self.bias] if self.bias is not None else [])]


class Int4Linear(Linear):
    """INT4 pack-quantized weight (W4A16): rows `[M, K]` through the kernel bound at load
    (`kernels.w4a16_linear_of`), any other shape through `kernels.w4a16_linear`."""

    def __init__(self, weight: W4A16Weight, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.kernel = w4a16_linear_of(weight)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] == self.weight.in_features:
            return self.kernel(x)
        return w4a16_linear(x, self.weight)

    def call(self, x: torch.Tensor, y: torch.Tensor) -> Call | None:
        native = self.weight.native
        if native is None or self.bias is not None or x.shape[1] != self.weight.in_features:
            return None
        return native.call(x, y)  # the bound kernel's

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors() + ([self.bias] if self.bias is not None else [])


def int4_copy(
    weight: torch.Tensor, group_size: int, ops: CpuOps, int8_activations: bool = False
) -> Int4Linear:
    """A W4A16 runtime copy of a dense weight `[N, K]`: symmetric round-to-nearest INT4 groups, the
    arithmetic of `kvq compress` (compressed-tensors'), prepared for the kernels on weight's device (for the
    W4A8 kernel with int8_activations, as a checkpoint's INT4 Linears under int4_compute "w4a8")."""
    weight_packed, weight_scale = quantize_pack_int4(weight, group_size)
    prepared = prepare_w4a16(
        weight_packed, weight_scale, group_size, int8_activations=int8_activations, cpu_ops=ops
    )
    return Int4Linear(prepared, None)


# an INT8 copy of a tied lm_head hands batches of this many rows on to the dense embedding it was made from:
# from ~12 rows oneDNN's BF16 GEMM outruns the W8A16 one (SmolLM2's [49152, 576], Zen 4, 2 threads: int8 /
# dense time 0.40x at 1 row, 0.72x at 8, 1.09x at 12, 1.19x at 32, 1.83x at 64)
INT8_DENSE_FROM_ROWS = 12


class Int8Linear(Linear):
    """INT8 weight with a scale per output row: W8A16 through `kernels.cpu.w8a16.w8a16_linear`, or W8A8
    (`kernels.cpu.w4a8.NativeW8A8`, activations in int8 as W4A8's). With `dense` (the resident weight it
    was made from: a tied embedding), batches of `INT8_DENSE_FROM_ROWS` rows or more run on that instead."""

    def __init__(self, weight: W8A16Weight | NativeW8A8, dense: DenseLinear | None = None) -> None:
        self.weight, self.dense, self.bias = weight, dense, None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() >= INT8_DENSE_FROM_ROWS * x.shape[-1]:
            return self.dense.matmul(x)
        if isinstance(self.weight, W8A16Weight):
            return w8a16_linear(x, self.weight)
        return self.weight(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.weight.out_features)

    def tensors(self) -> list[torch.Tensor]:
        w = self.weight
        own = [w.weight, w.weight_scale] if isinstance(w, W8A16Weight) else w.tensors()
        blocked = [] if self.dense is None or self.dense.packed is None else [self.dense.packed]
        return own + blocked  # the dense weight itself is the embedding's, counted there


def int8_copy(
    weight: torch.Tensor, ops: CpuOps, int8_activations: bool = False, dense: DenseLinear | None = None
) -> Int8Linear:
    """An INT8 runtime copy of a dense weight `[N, K]`: symmetric round-to-nearest INT8 rows, one scale per
    row (`kernels.cpu.w8a16.quantize_int8_rows`), on weight's device. With int8_activations (int4_compute
    "w4a8"), W8A8 where its kernel runs (a CPU path with one, K a multiple of 32; the scales in bf16, as
    W4A8 reads its own), else W8A16. `dense`: the weight's own resident Linear, for large batches."""
    path = w4a8_path(ops.isa) if int8_activations and weight.device.type == "cpu" else None
    if path is not None and w8a8_chunk(weight.shape[1]):
        return Int8Linear(NativeW8A8(*quantize_int8_rows(weight, torch.bfloat16), path=path), dense)
    return Int8Linear(prepare_w8a16(*quantize_int8_rows(weight), ops.isa), dense)


class ConcatLinear(Linear):
    """Row-stacked parts of different kinds (q/k/v or gate/up stored differently): outputs concatenated."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts, self.bias = parts, None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.tensors()]


def merge_stored(parts: list[StoredLinear]) -> StoredLinear | None:
    """Row-concatenate parts of one kind into a single stored Linear, or None when they cannot be.

    Dense and INT4 (same group size) concatenate exactly; FP8 blocks only when every part's row count
    is a multiple of the block height.
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    if any(p.kind != first.kind or p.group_size != first.group_size or p.block != first.block for p in parts):
        return None
    if first.kind == FP8 and any(p.out_features % first.block[0] for p in parts[:-1]):
        return None
    if first.kind == FP8 and any(p.tensors["weight_scale"].shape[0] == 1 for p in parts):
        return None  # per-tensor scales do not stack into a block grid
    biases = [p.bias for p in parts]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    tensors = {key: torch.cat([p.tensors[key] for p in parts]) for key in first.tensors}
    bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
    names = [n for p in parts for n in p.names]
    return StoredLinear(first.kind, tensors, first.block, first.group_size, bias, names)


@dataclass(frozen=True)
class LinearForms:
    """How stored Linears become runnable ones, one per engine (`WeightLoader.forms`, from `EngineConfig`):
    the activation `dtype` and `device`; the engine's kernels (CPU ones, and the backend: Triton or torch);
    reference mode (everything dense fp32); FP8 weights "per-use" or "bf16"; INT4 as "w4a16" or "w4a8"."""

    dtype: torch.dtype
    device: torch.device
    cpu_ops: CpuOps
    backend: str
    is_reference: bool = False
    fp8_weights: str = "per-use"
    int4_compute: str = "w4a16"

    @property
    def is_w4a8(self) -> bool:
        return self.int4_compute == "w4a8"


def build_linear(parts: list[StoredLinear], forms: LinearForms) -> Linear:
    """A ready-to-run Linear from stored parts (merged when possible), in `forms`.

    Reference mode (fp32 activations) dequantizes everything to dense fp32; otherwise dense weights are
    cast to the activation dtype, FP8 stays FP8 (or becomes that dtype with fp8_weights "bf16"), INT4 is
    prepared once for the kernel (on CPU: for the engine's path; int4_compute "w4a8": the W4A8 kernel).
    """
    merged = merge_stored(parts)
    if merged is None:
        return ConcatLinear([build_linear([p], forms) for p in parts])
    dtype, device, ops = forms.dtype, forms.device, forms.cpu_ops
    bias = None if merged.bias is None else merged.bias.to(device=device, dtype=dtype)
    if forms.is_reference or merged.kind == DENSE or (merged.kind == FP8 and forms.fp8_weights == "bf16"):
        return DenseLinear(merged.dense(dtype).to(device), bias, ops)
    if merged.kind == FP8:
        tensors = {k: v.to(device) for k, v in merged.tensors.items()}
        return Fp8Linear(StoredLinear(FP8, tensors, merged.block, names=merged.names), bias, ops)
    t = merged.tensors
    packed, scale = t["weight_packed"].to(device), t["weight_scale"].to(device)
    weight = prepare_w4a16(
        packed, scale, merged.group_size, backend=forms.backend, int8_activations=forms.is_w4a8, cpu_ops=ops
    )
    return Int4Linear(weight, bias)
