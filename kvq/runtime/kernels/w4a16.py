"""W4A16 linear layers: INT4 pack-quantized weights (compressed-tensors 0.19), 16-bit activations.

Layout (the contract): `weight_packed` int32 `[N, K/8]` (or `[E, N, K/8]` for stacked experts); nibble j
(bits 4j..4j+3) of word k holds `q[n, 8k+j] + 8` (first element in the lowest bits); `weight_scale`
`[N, K/group_size]` in bf16 (any float dtype is accepted); symmetric: real weight = q * scale;
y = x @ W^T with fp32 accumulation. group_size in {32, 64, 128}.
This file holds the reference (the spec), the prepared-weight type and the torch (CPU) path, which runs
kvq's native kernel (`cpu/linear.py`) or `aten._weight_int4pack_mm_for_cpu`; the Triton kernel is in
`triton/w4a16.py`. Imports torch, kvq.formats (the shared INT4 unpack) and kvq.runtime.kernels.cpu.linear.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvq.formats.pack_quantized import dequantize_pack_quantized, unpack_int4
from kvq.formats.shapes import GROUP_SIZES
from kvq.runtime.kernels.cpu.linear import NativeW4A16, native_scale, w4a16_native
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.kernels.cpu.w4a8 import NativeW4A8, w4a8_path

LAYOUT_COMPRESSED_TENSORS = "compressed-tensors"
LAYOUT_INT4PACK_CPU = "int4pack-cpu"
LAYOUT_NATIVE_CPU = "native-cpu"
LAYOUT_W4A8_CPU = "w4a8-cpu"
_INT4PACK_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` needs N % 16 == 0


def w4a16_reference(
    x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The spec: fp32 `[..., N]` = x.float() @ (q * scale)^T for x `[..., K]` (`group_size` is checked)."""
    assert weight_packed.shape[-1] * 8 == weight_scale.shape[-1] * group_size, (
        weight_scale.shape,
        group_size,
    )
    return x.float() @ dequantize_pack_quantized(weight_packed, weight_scale, dtype=torch.float32).T


@dataclass(frozen=True)
class W4A16Weight:
    """An INT4 weight prepared once at load for the backend that will run it (see `prepare_w4a16`).

    `layout` says which tensors are set:
    - "compressed-tensors": `weight_packed` int32 `[(E,) N, K/8]` and `weight_scale` `[(E,) N, K/G]` as
      loaded (Triton on any device; the torch path off-CPU dequantizes per call).
    - "native-cpu": `weight_packed` as loaded and `weight_scale` (bf16 as loaded, other dtypes as fp32)
      for kvq's CPU kernel; `cpu_isa` names its path ("amx", "avx512bf16", "avx512", "avx2" or "scalar") and
      `native` (plain weights only) is the kernel call with the weight's arguments bound.
    - "w4a8-cpu": `native` only, the W4A8 kernel (`w4a8_cpu.NativeW4A8`) holding the weight (or stacked
      experts) in its own layout (int8 activations, opt-in: `EngineConfig.int4_compute`).
    - "int4pack-cpu": `int4pack` uint8 `[(E,) N16, K/2]` for `aten._weight_int4pack_mm_for_cpu` and
      `scales_and_zeros` `[(E,) K/G, N16, 2]` (zeros are 0); N16 = N rounded up to a multiple of 16.
    """

    backend: str  # "torch" | "triton"
    layout: str
    out_features: int  # N
    in_features: int  # K
    group_size: int
    num_experts: int | None  # None for a plain linear, E for stacked experts
    weight_packed: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    int4pack: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None
    cpu_isa: str | None = None
    cpu_dot: str | None = None  # avx512bf16 / amx: how bf16 activations multiply (`CpuOps.dot`)
    native: NativeW4A16 | NativeW4A8 | None = None

    @property
    def device(self) -> torch.device:
        tensor = self.weight_packed if self.weight_packed is not None else self.int4pack
        if tensor is None and isinstance(self.native, NativeW4A8):
            tensor = self.native.w
        assert tensor is not None
        return tensor.device

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this weight keeps resident (a W4A8 layout's own; a W4A16 kernel call shares the
        loaded ones)."""
        held = [self.weight_packed, self.weight_scale, self.int4pack, self.scales_and_zeros]
        native = self.native.tensors() if isinstance(self.native, NativeW4A8) else []
        return [t for t in held if t is not None] + native


def check_w4a16_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> None:
    """Raise ValueError/TypeError naming the tensor when the pair breaks the pack-quantized contract."""
    if weight_packed.dtype != torch.int32:
        raise TypeError(
            f"weight_packed must be int32 (compressed-tensors pack-quantized), got {weight_packed.dtype}"
        )
    if not weight_scale.is_floating_point():
        raise TypeError(f"weight_scale must be a float tensor (bf16 on disk), got {weight_scale.dtype}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if weight_packed.dim() not in (2, 3) or weight_scale.dim() != weight_packed.dim():
        raise ValueError(
            f"weight_packed {tuple(weight_packed.shape)} and weight_scale {tuple(weight_scale.shape)} must "
            "both be [N, K/8] / [N, K/group_size] (or [E, N, ...] for stacked experts)"
        )
    in_features = weight_packed.shape[-1] * 8
    expected = (*weight_packed.shape[:-1], in_features // group_size)
    if in_features % group_size or tuple(weight_scale.shape) != expected:
        raise ValueError(
            f"weight_scale has shape {tuple(weight_scale.shape)}, expected {expected} for weight_packed "
            f"{tuple(weight_packed.shape)} (K={in_features}) with group_size {group_size}"
        )
    if weight_packed.device != weight_scale.device:
        raise ValueError(
            f"weight_packed is on {weight_packed.device} but weight_scale on {weight_scale.device}"
        )


def to_int4pack_cpu(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K/8]` pack-quantized -> (`int4pack` uint8 `[N16, K/2]`, `scales_and_zeros` `[K/G, N16, 2]`).

    The CPU op dequantizes nibble u as `(u - 8) * scale + zero`; our nibble is q + 8, so zero = 0
    (checked against `w4a16_reference` in the tests). Rows are padded with q = 0, scale = 0 up to N16.
    """
    num_rows = weight_packed.shape[0]
    pad = -num_rows % _INT4PACK_N_MULTIPLE
    nibbles = unpack_int4(weight_packed).to(torch.int32) + 8  # [N, K], 0..15
    scale = weight_scale
    if pad:
        nibbles = torch.cat([nibbles, nibbles.new_full((pad, nibbles.shape[1]), 8)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
    int4pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.contiguous(), 1)
    scales_and_zeros = torch.stack([scale.T, torch.zeros_like(scale.T)], dim=-1).contiguous()
    return int4pack, scales_and_zeros


def compressed_tensors_weight(
    backend: str, weight_packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int
) -> W4A16Weight:
    """A weight kept in the compressed-tensors layout, as loaded (made contiguous)."""
    return W4A16Weight(
        backend=backend,
        layout=LAYOUT_COMPRESSED_TENSORS,
        out_features=weight_packed.shape[-2],
        in_features=weight_packed.shape[-1] * 8,
        group_size=group_size,
        num_experts=weight_packed.shape[0] if weight_packed.dim() == 3 else None,
        weight_packed=weight_packed.contiguous(),
        weight_scale=weight_scale.contiguous(),
    )


def prepare_w4a16_torch(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    group_size: int,
    int8_activations: bool = False,
    cpu_ops: CpuOps | None = None,
) -> W4A16Weight:
    """Torch-path weight on CPU: for the native kernel of the engine's CPU path (`cpu_ops`; None:
    `CpuOps.choose()`), kept as loaded, or repacked for the CPU int4 op (path torch, or no native one);
    with int8_activations, in the W4A8 kernel's layout (where one runs: `w4a8_path`; stacked experts
    too); kept as loaded on other devices."""
    loaded = compressed_tensors_weight("torch", weight_packed, weight_scale, group_size)
    if weight_packed.device.type != "cpu":
        return loaded
    ops = CpuOps.choose() if cpu_ops is None else cpu_ops
    w4a8 = w4a8_path(ops.isa) if int8_activations else None
    if w4a8 is not None:
        native_w4a8 = NativeW4A8(weight_packed.contiguous(), weight_scale, group_size, w4a8)
        return replace(
            loaded, layout=LAYOUT_W4A8_CPU, weight_packed=None, weight_scale=None, native=native_w4a8
        )
    isa = ops.isa
    if isa != "torch":
        assert loaded.weight_packed is not None
        scale = native_scale(weight_scale)
        native = (
            NativeW4A16(loaded.weight_packed, scale, group_size, isa, ops.scratch, ops.dot)
            if weight_packed.dim() == 2
            else None
        )
        return replace(
            loaded, layout=LAYOUT_NATIVE_CPU, weight_scale=scale, cpu_isa=isa, cpu_dot=ops.dot, native=native
        )
    stacked_packed = weight_packed.reshape(-1, *weight_packed.shape[-2:])
    stacked_scale = weight_scale.reshape(-1, *weight_scale.shape[-2:])
    pairs = [to_int4pack_cpu(p, s) for p, s in zip(stacked_packed, stacked_scale, strict=True)]
    int4pack = torch.stack([p for p, _ in pairs])  # [E, N16, K/2]
    scales_and_zeros = torch.stack([s for _, s in pairs])  # [E, K/G, N16, 2]
    if loaded.num_experts is None:
        int4pack, scales_and_zeros = int4pack[0], scales_and_zeros[0]
    return replace(
        loaded,
        layout=LAYOUT_INT4PACK_CPU,
        weight_packed=None,
        weight_scale=None,
        int4pack=int4pack,
        scales_and_zeros=scales_and_zeros,
    )


def w4a16_linear_torch(x: torch.Tensor, w: W4A16Weight, expert: int | None = None) -> torch.Tensor:
    """Torch path: `[M, K]` -> `[M, N]` in x.dtype; `expert` picks one of stacked experts.

    On CPU the native kernel takes fp32, bf16 and fp16 alike. The int4 op runs in the dtype of its
    scales: bf16 is its fast path; other activation dtypes get the scales cast per call and take the
    op's slow path (fp16 is ~35x slower than bf16 there).
    """
    assert (expert is None) == (w.num_experts is None), "pass expert= exactly for stacked experts"
    if w.layout == LAYOUT_W4A8_CPU:
        assert isinstance(w.native, NativeW4A8)
        return w.native(x, expert)
    if w.layout == LAYOUT_NATIVE_CPU:
        assert w.weight_packed is not None and w.weight_scale is not None and w.cpu_isa is not None
        packed = w.weight_packed if expert is None else w.weight_packed[expert]
        scale = w.weight_scale if expert is None else w.weight_scale[expert]
        return w4a16_native(x, packed, scale, w.group_size, w.cpu_isa, dot=w.cpu_dot)
    if w.layout == LAYOUT_COMPRESSED_TENSORS:
        assert w.weight_packed is not None and w.weight_scale is not None
        packed = w.weight_packed if expert is None else w.weight_packed[expert]
        scale = w.weight_scale if expert is None else w.weight_scale[expert]
        return w4a16_reference(x, packed, scale, w.group_size).to(x.dtype)
    assert w.int4pack is not None and w.scales_and_zeros is not None
    int4pack = w.int4pack if expert is None else w.int4pack[expert]
    scales_and_zeros = w.scales_and_zeros if expert is None else w.scales_and_zeros[expert]
    if scales_and_zeros.dtype != x.dtype:
        scales_and_zeros = scales_and_zeros.to(x.dtype)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), int4pack, w.group_size, scales_and_zeros)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features]
