"""W4A8 on CPU (opt-in, `EngineConfig.int4_compute="w4a8"`): a compressed-tensors INT4 weight times
activations quantized to int8 per row and chunk of `w4a8_chunk(group_size)` inputs, in exact integer sums on
AVX-512 VNNI or AVX2 (`_w4a8_cpu.h`, which says why and how); and W8A8, the same kernels over an INT8
weight with a scale per row (the INT8 lm_head copy, `lm_head_weights="int8"`, in that mode).

`w4a8_pack` / `w8a8_pack` lay a weight out for the kernel once, at load (the same 4 / 8 bits a weight, in
tiles of 16 output rows); `NativeW4A8` / `NativeW8A8` run it; `w4a8_reference` / `w8a8_reference` are the
same arithmetic in torch: the oracles of the tests. Imports torch and kvq.runtime.kernels.cpu.linear.
"""

from __future__ import annotations

import torch

from kvq.formats.pack_quantized import unpack_int4
from kvq.runtime.kernels.cpu.isa import _DTYPE_CODES, Call, _ext, resolve_cpu_isa
from kvq.runtime.kernels.cpu.linear import native_scale

TILE_ROWS = 16  # output rows per tile: one per 32-bit lane of a 512-bit vector
KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # activations and outputs the kernel reads and writes
W4A8_PATHS = ("vnni", "avx2")  # the kernels: AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw


def w4a8_runnable() -> tuple[str, ...]:
    """The W4A8 kernels this CPU and build run (`W4A8_PATHS`' names; empty without the extension)."""
    if _ext is None or not hasattr(_ext, "w4a8_paths"):
        return ()
    return tuple(name for name, ok in zip(W4A8_PATHS, _ext.w4a8_paths(), strict=True) if ok)


def w4a8_path(isa: str | None = None) -> str | None:
    """The kernel `int4_compute="w4a8"` runs on CPU path `isa` (None: `resolve_cpu_isa()`): vnni on an
    AVX-512 one where the CPU has VNNI, else avx2 on any SIMD one (a held avx2 path stands for a CPU
    without AVX-512); None on scalar and torch."""
    isa, runnable = resolve_cpu_isa() if isa is None else isa, w4a8_runnable()
    if isa in ("amx", "avx512bf16", "avx512") and "vnni" in runnable:
        return "vnni"
    return "avx2" if isa in ("amx", "avx512bf16", "avx512", "avx2") and "avx2" in runnable else None


def w4a8_chunk(group_size: int) -> int:
    """Inputs per activation scale: min(group, 64), so that a chunk lies in one weight group."""
    return min(group_size, 64)


def w4a8_pack(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' `weight_packed` int32 `[N, K/8]` and `weight_scale` `[N, K/G]` as the kernel reads
    them: uint8 `[tiles, chunks, C/8, 64]` (byte 4l + j of vector v: u = q + 8 of the tile's row l, chunk
    input 4v + j in the low nibble and 4(v + C/8) + j in the high one) and the scales `[tiles, K/G, 16]`
    (`tile_scales`; bf16 as stored, another dtype as fp32: `native_scale`). Rows past N (the last tile's)
    have q = 0 and scale 0."""
    num_rows, in_features = weight_packed.shape[0], weight_packed.shape[1] * 8
    chunk = w4a8_chunk(group_size)
    chunks, vectors = in_features // chunk, chunk // 8
    tiles = -(-num_rows // TILE_ROWS)
    u = torch.full((tiles * TILE_ROWS, in_features), 8, dtype=torch.uint8)
    u[:num_rows] = (unpack_int4(weight_packed) + 8).to(torch.uint8)
    steps = u.view(tiles, TILE_ROWS, chunks, 2, vectors, 4).permute(0, 2, 4, 1, 5, 3)  # [t, c, v, l, j, half]
    w = (steps[..., 0] | (steps[..., 1] << 4)).contiguous().view(tiles, chunks, vectors, 64)
    return w, tile_scales(native_scale(weight_scale), tiles)


def tile_scales(stored: torch.Tensor, tiles: int) -> torch.Tensor:
    """Scales `[N, columns]` as the kernel reads them: `[tiles, columns, 16]`, rows past N zero."""
    scale = torch.zeros(tiles * TILE_ROWS, stored.shape[1], dtype=stored.dtype)
    scale[: stored.shape[0]] = stored
    return scale.view(tiles, TILE_ROWS, -1).transpose(1, 2).contiguous()


def w8a8_chunk(in_features: int) -> int | None:
    """Inputs per activation scale for an INT8 weight of `in_features` columns: 64, else 32 (the kernel's
    two), or None when neither divides it (the W8A16 kernel runs)."""
    return next((chunk for chunk in (64, 32) if in_features % chunk == 0), None)


def w8a8_pack(
    weight: torch.Tensor, weight_scale: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 weight `[N, K]` with its scale per row `[N]` (`kernels.w8a16.quantize_int8_rows`) as the
    kernel reads it: uint8 `[tiles, chunks, C/4, 64]` (byte 4l + j of vector v: u = q + 128 of the tile's row
    l, chunk input 4v + j) and the row scales `[tiles, 1, 16]` (`native_scale`'s dtype). Rows past N (the
    last tile's) have q = 0 and scale 0."""
    num_rows, in_features = weight.shape
    chunks, tiles = in_features // chunk, -(-num_rows // TILE_ROWS)
    u = torch.full((tiles * TILE_ROWS, in_features), 128, dtype=torch.uint8)
    u[:num_rows] = (weight.to(torch.int16) + 128).to(torch.uint8)
    steps = u.view(tiles, TILE_ROWS, chunks, chunk // 4, 4).permute(0, 2, 3, 1, 4)  # [t, c, v, l, j]
    w = steps.contiguous().view(tiles, chunks, chunk // 4, 64)
    return w, tile_scales(native_scale(weight_scale)[:, None], tiles)


class NativeW4A8:
    """One INT4 weight's W4A8 kernel call, its packed layout bound (`w4a8_pack`): a plain `[N, K/8]` weight,
    or stacked experts `[E, N, K/8]` (each packed alone; a call names its expert); path: "vnni" or "avx2"
    (default: `w4a8_path()`)."""

    __slots__ = ("w", "scale", "out_features", "chunk", "path", "num_experts", "_weight_args")
    wide = False  # 8-bit weights (NativeW8A8)

    def __init__(
        self,
        weight_packed: torch.Tensor,
        weight_scale: torch.Tensor,
        group_size: int,
        path: str | None = None,
    ) -> None:
        if weight_packed.dim() == 3:  # stacked experts, packed one at a time into the stacked layout
            w0, s0 = w4a8_pack(weight_packed[0], weight_scale[0], group_size)
            w = w0.new_empty((weight_packed.shape[0], *w0.shape))
            scale = s0.new_empty((weight_packed.shape[0], *s0.shape))
            for e in range(weight_packed.shape[0]):
                w[e], scale[e] = w4a8_pack(weight_packed[e], weight_scale[e], group_size)
        else:
            w, scale = w4a8_pack(weight_packed, weight_scale, group_size)
        self._bind(w, scale, weight_packed.shape[-2], w4a8_chunk(group_size), path)

    def _bind(
        self, w: torch.Tensor, scale: torch.Tensor, out_features: int, chunk: int, path: str | None
    ) -> None:
        self.w, self.scale, self.out_features, self.chunk = w, scale, out_features, chunk
        self.path = path or w4a8_path()
        assert self.path in w4a8_runnable(), f"the W4A8 {self.path} kernel does not run here"
        stacked = w.dim() == 5
        self.num_experts = w.shape[0] if stacked else None
        parts = list(zip(w, scale, strict=True)) if stacked else [(w, scale)]
        self._weight_args = [  # each expert's (or the weight's) call arguments, bound once
            (
                int(self.wide),
                a.data_ptr(),
                b.data_ptr(),
                _DTYPE_CODES[b.dtype],
                b.shape[-2],
                out_features,
                chunk,
            )
            for a, b in parts
        ]

    def __call__(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """x `[M, K]` -> `[M, N]` in x.dtype (bf16 and fp32 as they are, another dtype through fp32); expert:
        which of stacked experts (exactly for stacked ones)."""
        if x.dtype not in KERNEL_DTYPES:
            return self(x.float(), expert).to(x.dtype)
        x = x.contiguous()
        y = torch.empty((x.shape[0], self.out_features), dtype=x.dtype)
        call = self.call(x, y, expert)
        assert call is not None
        call[0](*call[1])
        return y

    def call(self, x: torch.Tensor, y: torch.Tensor, expert: int | None = None) -> Call | None:
        """The C call of `self(x, expert)` into y `[M, N]` (both contiguous), or None for dtypes it does not
        take."""
        if x.dtype not in KERNEL_DTYPES or y.dtype not in KERNEL_DTYPES:
            return None
        assert _ext is not None, "w4a8_runnable() was checked when this NativeW4A8 was made"
        assert (expert is None) == (self.num_experts is None), "pass expert= exactly for stacked experts"
        (num_rows, in_features), threads = x.shape, torch.get_num_threads()
        return _ext.gemm_w4a8, (
            int(self.path == "avx2"), threads, x.data_ptr(), _DTYPE_CODES[x.dtype], num_rows, in_features,
            *self._weight_args[expert or 0], y.data_ptr(), _DTYPE_CODES[y.dtype],
        )  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        return [self.w, self.scale]


class NativeW8A8(NativeW4A8):
    """One INT8 weight's W8A8 call (`w8a8_pack`): int8 `[N, K]` with a scale per row `[N]`, K a multiple of 32
    (`w8a8_chunk`); path as NativeW4A8's."""

    __slots__ = ()
    wide = True

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, path: str | None = None) -> None:
        chunk = w8a8_chunk(weight.shape[1])
        assert chunk is not None, f"W8A8 takes K a multiple of 32, got {weight.shape[1]}"
        self._bind(*w8a8_pack(weight, weight_scale, chunk), weight.shape[0], chunk, path)


def quantize_activations(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations: x `[M, K]` as int8 values `[M, K]` (in an int32 tensor) and fp32 scales
    `[M, K/chunk]`: per chunk amax = max |x|, xq = rint(x * (127 / amax)), xs = amax / 127, in fp32."""
    xc = x.float().view(x.shape[0], -1, chunk)
    amax = xc.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xc * inv).clamp(-127, 127).to(torch.int32)
    return xq.view(x.shape[0], -1), (amax / 127.0).squeeze(-1)


def w4a8_reference(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The kernel's result in fp64: per chunk c, the exact integer sum of q * xq times scale * xs (both fp32,
    their product rounded to fp32 as the kernel does), summed over chunks. `[M, N]` fp64."""
    chunk = w4a8_chunk(group_size)
    xq, xs = quantize_activations(x, chunk)
    q = unpack_int4(weight_packed).to(torch.float64)  # [N, K]
    num_rows, chunks = q.shape[0], q.shape[1] // chunk
    sums = torch.einsum("mcj,ncj->mnc", xq.double().view(-1, chunks, chunk), q.view(num_rows, chunks, chunk))
    ws = native_scale(weight_scale).float().repeat_interleave(group_size // chunk, dim=1)  # [N, chunks]
    factors = (ws.unsqueeze(0) * xs.unsqueeze(1)).double()  # fp32 products, [M, N, chunks]
    return (sums * factors).sum(dim=-1)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """NativeW8A8's result in fp64: per chunk, the exact integer sum of q * xq times weight_scale * xs (both
    fp32, their product rounded to fp32), summed over chunks. `[M, N]` fp64."""
    chunk = w8a8_chunk(weight.shape[1])
    assert chunk is not None
    xq, xs = quantize_activations(x, chunk)
    num_rows, chunks = weight.shape[0], weight.shape[1] // chunk
    q = weight.double().view(num_rows, chunks, chunk)
    sums = torch.einsum("mcj,ncj->mnc", xq.double().view(-1, chunks, chunk), q)
    factors = (native_scale(weight_scale).float()[None, :, None] * xs.unsqueeze(1)).double()  # [M, N, chunks]
    return (sums * factors).sum(dim=-1)
