"""The native CPU W4A16 kernel: which path runs (`--cpu-isa`, chosen at load) and the launchers over the C
extension (the W8A16 and dense BF16 entries' too: `gemm_w8`, `gemm_dense` on AMX tiles, `gemv_dense` for one
row).

`_linear` (built with the package, optional) reads the compressed-tensors layout as loaded (see
`w4a16.py`) with AMX (avx512bf16, but batches of at least `AMX_FROM_ROWS` bf16 rows through AMX tiles
over compressed-tensors' bf16(q * scale)), AVX-512 BF16 (AVX-512, but bf16 activations through
vdpbf16ps, or as fixed point through VNNI's vpdpbusd), AVX-512, AVX2 + FMA or scalar C loops
chosen at run time. On avx512bf16, batches of at least `dense_from_rows` bf16 rows (prefill, and on
the vdpbf16ps GEMM from 32 rows; amx: `AMX_DENSE_FROM_ROWS`) instead decompress the weight to bf16
(`dequantize`, in chunks of rows) and run torch's BF16 GEMM (oneDNN). Without the extension, or on the
`torch` path, the CPU path is `aten._weight_int4pack_mm_for_cpu`. Imports torch and kvq.errors.
"""

from __future__ import annotations

import torch

from kvq.runtime.kernels.cpu.isa import (
    _DTYPE_CODES,
    _ISA_CODES,
    AMX_DENSE_FROM_ROWS,
    AMX_FROM_ROWS,
    BF16_DOT_ISAS,
    DENSE_CHUNK_ELEMENTS,
    DENSE_FROM_ROWS,
    VDPBF16PS_DENSE_FROM_ROWS,
    Call,
    _ext,
    bf16_dot,
)


def native_scale(weight_scale: torch.Tensor) -> torch.Tensor:
    """`weight_scale` as the native kernel reads it: bf16 as stored, any other float dtype as fp32."""
    scale = weight_scale if weight_scale.dtype == torch.bfloat16 else weight_scale.float()
    return scale.contiguous()


class NativeW4A16:
    """One prepared plain (not stacked) weight's `w4a16_native` with its constant arguments bound: decode
    calls ~100 Linears per token, so the per-call Python (~1 us per line here) is worth keeping short."""

    __slots__ = (
        "weight_packed", "weight_scale", "group_size", "isa", "_isa_code", "_few_rows_code",
        "_dense_from_rows", "_ptrs", "_scale_code", "scratch", "_vnni",
    )  # fmt: skip

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        group_size: int,
        isa: str,
        scratch: DenseScratch,
        dot: str | None = None,
    ):
        """`dot`: how bf16 activations multiply on avx512bf16 / amx (`bf16_dot`; None: asked now)."""
        self.weight_packed, self.weight_scale = weight_packed, weight_scale  # keep the addresses valid
        self.group_size, self.isa, self._isa_code = group_size, isa, _ISA_CODES[isa]
        self.scratch = scratch  # the engine's, shared by its weights (`dense_matmul`)
        dot = dot_of(isa) if dot is None else dot
        self._few_rows_code, self._vnni = _ISA_CODES[_few_rows_isa(isa)], int(dot == "vnni")
        self._dense_from_rows = dense_from_rows(isa, dot)
        self._ptrs = (weight_packed.data_ptr(), weight_scale.data_ptr())
        self._scale_code = _DTYPE_CODES[weight_scale.dtype]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[M, K]` -> `[M, N]` in x.dtype."""
        if x.dtype not in _DTYPE_CODES or not x.is_contiguous():  # an error or a copy: the general path
            dot = "vnni" if self._vnni else "bf16"
            return w4a16_native(x, self.weight_packed, self.weight_scale, self.group_size, self.isa, dot=dot)
        num_rows = x.shape[0]
        if num_rows >= self._dense_from_rows and x.dtype == torch.bfloat16:
            return dense_matmul(x, self.weight_packed, self.weight_scale, self.group_size, self.scratch)
        code = self._isa_code if num_rows >= AMX_FROM_ROWS else self._few_rows_code
        y = torch.empty((num_rows, self.weight_packed.shape[0]), dtype=x.dtype)
        fn, bound = _gemm_call(code, self._vnni, x, *self._ptrs, self._scale_code, self.group_size, y)
        fn(*bound)
        return y

    def call(self, x: torch.Tensor, y: torch.Tensor) -> Call | None:
        """`self(x)`'s C call into y `[M, N]` (both contiguous, a native dtype), or None where `self(x)`
        takes torch's GEMM (`dense_matmul`)."""
        num_rows = x.shape[0]
        if num_rows >= self._dense_from_rows and x.dtype == torch.bfloat16:
            return None
        code = self._isa_code if num_rows >= AMX_FROM_ROWS else self._few_rows_code
        return _gemm_call(code, self._vnni, x, *self._ptrs, self._scale_code, self.group_size, y)


def dot_of(isa: str) -> str | None:
    """`bf16_dot()` on the paths it concerns (avx512bf16, amx: $KVQ_CPU_DOT, else by vendor), else None."""
    return bf16_dot() if isa in BF16_DOT_ISAS else None


def _few_rows_isa(isa: str) -> str:
    """The path that runs batches of fewer than `AMX_FROM_ROWS` rows on `isa`: avx512bf16's for amx."""
    return "avx512bf16" if isa == "amx" else isa


def dense_from_rows(isa: str, dot: str | None = None) -> int | float:
    """From how many bf16 rows `NativeW4A16` on `isa` (and `dot`; None: `bf16_dot()`) runs `dense_matmul`
    instead (inf: never)."""
    if isa == "avx512bf16":
        dot = bf16_dot() if dot is None else dot
        return VDPBF16PS_DENSE_FROM_ROWS if dot == "bf16" else DENSE_FROM_ROWS
    return AMX_DENSE_FROM_ROWS if isa == "amx" else float("inf")


def w4a16_native(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    isa: str,
    out_dtype: torch.dtype | None = None,
    dot: str | None = None,
) -> torch.Tensor:
    """y `[M, N]` in out_dtype (default x.dtype) = x `[M, K]` @ (q * scale)^T on path `isa` (fp32 sums;
    amx's AMX GEMM, bf16 x of at least `AMX_FROM_ROWS` rows: x @ bf16(q * scale)^T).

    `weight_packed` int32 `[N, K/8]`, `weight_scale` `[N, K/G]` from `native_scale` (both contiguous,
    checked at prepare); x fp32, bf16 or fp16 (copied if not contiguous). `dot` as `NativeW4A16`'s (None:
    asked now). Threads: torch.get_num_threads().
    """
    if x.dtype not in _DTYPE_CODES:
        raise TypeError(f"the CPU W4A16 kernel takes fp32, bf16 or fp16 activations, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty((x.shape[0], weight_packed.shape[0]), dtype=out_dtype or x.dtype)
    scale_code = _DTYPE_CODES[weight_scale.dtype]
    ptrs = (weight_packed.data_ptr(), weight_scale.data_ptr())
    code = _ISA_CODES[isa if x.shape[0] >= AMX_FROM_ROWS else _few_rows_isa(isa)]
    vnni = int((dot_of(isa) if dot is None else dot) == "vnni")
    fn, bound = _gemm_call(code, vnni, x, *ptrs, scale_code, group_size, y)
    fn(*bound)
    return y


class DenseScratch:
    """A bf16 buffer that `dense_matmul` decompresses weights into, grown to the largest chunk asked for and
    reused: one per engine (its `CpuOps`), shared by all its weights (one forward runs at a time)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.bfloat16)

    def take(self, numel: int) -> torch.Tensor:
        """The first `numel` elements of the buffer (grown first where it is smaller)."""
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.bfloat16)
        return self.buffer[:numel]


def dequantize(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int, isa: str, out: torch.Tensor
) -> None:
    """out bf16 `[N, K]` = bf16(q * scale) of the prepared weight (`native_scale`), compressed-tensors'
    decompression, bit for bit (q * scale is exact in fp32, rounded once)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    num_rows, in_features = out.shape
    scale_code = _DTYPE_CODES[weight_scale.dtype]
    args = (weight_packed.data_ptr(), weight_scale.data_ptr(), scale_code, num_rows, in_features, group_size)
    _ext.dequantize(_ISA_CODES[isa], torch.get_num_threads(), *args, out.data_ptr())


def dense_matmul(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    scratch: DenseScratch,
) -> torch.Tensor:
    """x bf16 `[M, K]` @ bf16(q * scale)^T through torch's BF16 GEMM, the weight decompressed in chunks of
    output rows into `scratch` (never a whole bf16 copy of a large weight)."""
    (num_rows, in_features), out_features = x.shape, weight_packed.shape[0]
    rows_per_chunk = max(1, min(out_features, DENSE_CHUNK_ELEMENTS // in_features))
    buffer = scratch.take(rows_per_chunk * in_features)
    if rows_per_chunk == out_features:
        w = buffer.view(out_features, in_features)
        dequantize(weight_packed, weight_scale, group_size, "avx512bf16", w)
        return torch.nn.functional.linear(x, w)
    y = torch.empty(num_rows, out_features, dtype=x.dtype)
    for n0 in range(0, out_features, rows_per_chunk):
        n1 = min(out_features, n0 + rows_per_chunk)
        w = buffer[: (n1 - n0) * in_features].view(n1 - n0, in_features)
        dequantize(weight_packed[n0:n1], weight_scale[n0:n1], group_size, "avx512bf16", w)
        y[:, n0:n1] = torch.nn.functional.linear(x, w)
    return y


def _gemm_call(
    isa_code: int,
    vnni: int,
    x: torch.Tensor,
    packed: int,
    scale: int,
    scale_code: int,
    group_size: int,
    y: torch.Tensor,
) -> Call:
    """The C call on contiguous x `[M, K]` into y `[M, N]` (dtypes checked by the caller); vnni:
    avx512bf16's bf16 activations as VNNI integer sums (1) or vdpbf16ps pairs (0)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    (num_rows, in_features), out_features = x.shape, y.shape[1]
    x_code, y_code, threads = _DTYPE_CODES[x.dtype], _DTYPE_CODES[y.dtype], torch.get_num_threads()
    args = (x.data_ptr(), x_code, num_rows, in_features, packed, scale, scale_code, out_features)
    return _ext.gemm, (isa_code, threads, *args, group_size, y.data_ptr(), y_code, vnni)


def gemm_w8(
    isa: str, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, y: torch.Tensor
) -> None:
    """The W8A16 C call (`kernels.cpu.w8a16`): contiguous x `[M, K]` into y `[M, N]` for int8 weight `[N, K]`
    and its fp32 / bf16 row scales (dtypes and shapes checked by the caller)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    (num_rows, in_features), out_features = x.shape, weight.shape[0]
    _ext.gemm_w8(
        _ISA_CODES[isa], torch.get_num_threads(), x.data_ptr(), _DTYPE_CODES[x.dtype], num_rows, in_features,
        weight.data_ptr(), weight_scale.data_ptr(), _DTYPE_CODES[weight_scale.dtype], out_features,
        y.data_ptr(), _DTYPE_CODES[y.dtype],
    )  # fmt: skip


def gemv_dense(isa: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bf16 `[1, N]` = one bf16 row x `[1, K]` @ weight^T for a contiguous bf16 weight `[N, K]` on native path
    `isa` (its GEMV: fp32 sums, rounded once; AVX-512's on every AVX-512 path). The decode row of a dense
    BF16 Linear: torch's GEMM dispatch sends it to oneDNN, which on AVX-512 BF16 CPUs copies the whole
    weight into a blocked buffer at every call (~2x the time of this GEMV on SmolLM2's lm_head, Zen 4)."""
    y = torch.empty((1, weight.shape[0]), dtype=torch.bfloat16)
    fn, bound = gemv_dense_call(isa, x.contiguous(), weight, y)
    fn(*bound)
    return y


def gemv_dense_call(isa: str, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> Call:
    """`gemv_dense`'s C call into contiguous bf16 y `[1, N]` (x contiguous)."""
    assert _ext is not None, "resolve_cpu_isa() picks a native path only when the extension is built"
    (out_features, in_features), threads = weight.shape, torch.get_num_threads()
    args = (x.data_ptr(), in_features, weight.data_ptr(), out_features, y.data_ptr())
    return _ext.gemv_dense, (_ISA_CODES[isa], threads, *args)


def gemm_dense(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> None:
    """The dense BF16 C call on AMX tiles (`_dense_cpu_amx.h`): contiguous bf16 x `[M, K]` into y `[M, N]`
    for a contiguous bf16 weight `[N, K]`, K a multiple of 32 (checked by the caller; amx runnable)."""
    fn, bound = gemm_dense_call(x, weight, y)
    fn(*bound)


def gemm_dense_call(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> Call:
    """`gemm_dense`'s C call."""
    assert _ext is not None, "the caller checks that the amx path is runnable"
    (num_rows, in_features), out_features = x.shape, weight.shape[0]
    return _ext.gemm_dense, (
        torch.get_num_threads(), x.data_ptr(), num_rows, in_features, weight.data_ptr(), out_features,
        y.data_ptr(), _DTYPE_CODES[y.dtype],
    )  # fmt: skip
