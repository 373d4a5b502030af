"""W4A16: both backends against `w4a16_reference` (the spec).

The pack layout against compressed-tensors is in test_w4a16_layout.py, so this file imports neither
compressed-tensors nor llm-compressor and runs on the GPU machine (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from kvq.formats.pack_quantized import dequantize_pack_quantized, unpack_int4
from kvq.runtime.kernels import prepare_w4a16, w4a16_linear, w4a16_linear_of
from kvq.runtime.kernels.triton.w4a16 import W4A16LaunchConfig, w4a16_linear_triton
from kvq.runtime.kernels.w4a16 import w4a16_reference
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, random_w4a16


def test_reference_is_dense_matmul_of_q_times_scale() -> None:
    gen = torch.Generator().manual_seed(1)
    packed, scale = random_w4a16(24, 128, 32, gen)
    q = unpack_int4(packed).float()
    dense = q * scale.float().repeat_interleave(32, dim=1)
    assert torch.equal(dequantize_pack_quantized(packed, scale, dtype=torch.float32), dense)
    x = torch.randn(3, 128, generator=gen)
    assert_close_rel(w4a16_reference(x, packed, scale, 32), x @ dense.T, 1e-6)


TRITON_CASES = [
    # (M, N, K, group_size, dtype, config): irregular M/N, default and forced tiles, split-K 1..3
    (3, 200, 384, 64, torch.float16, None),
    (1, 200, 384, 128, torch.float32, None),
    (17, 72, 256, 32, torch.bfloat16, W4A16LaunchConfig(block_m=16, block_n=32, block_k=32, split_k=3)),
    (70, 24, 192, 64, torch.float16, None),
    (2, 8, 32, 32, torch.float16, None),  # N below one tile, K one group
    (5, 100, 256, 128, torch.float16, None),  # default: nibble planes
    (3, 40, 512, 128, torch.float16, W4A16LaunchConfig(16, 32, 128, split_k=2, nibble_planes=True)),
    (4, 72, 256, 128, torch.float16, W4A16LaunchConfig(16, 64, 128, nibble_planes=False)),
    (2, 24, 256, 128, torch.bfloat16, W4A16LaunchConfig(16, 32, 128, nibble_planes=True)),  # fp32 dot here
]


@pytest.mark.parametrize(
    ("num_rows", "out_features", "in_features", "group_size", "dtype", "config"), TRITON_CASES
)
def test_triton_matches_reference(
    num_rows: int,
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
    config: W4A16LaunchConfig | None,
) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype)
    w = prepare_w4a16(packed, scale, group_size, backend="triton")
    y = w4a16_linear_triton(x, w, config)
    assert y.dtype == dtype
    assert_close_rel(y, w4a16_reference(x, packed, scale, group_size), REL_TOL[dtype])


def test_triton_reads_strided_activations() -> None:
    gen = torch.Generator().manual_seed(2)
    packed, scale = random_w4a16(50, 128, 128, gen)
    x = torch.randn(128, 5, generator=gen).to(torch.float16).T  # [5, 128], stride_xk = 5
    y = w4a16_linear(x, prepare_w4a16(packed, scale, 128, backend="triton"))
    assert_close_rel(y, w4a16_reference(x, packed, scale, 128), REL_TOL[torch.float16])


CPU_CASES = [
    # (leading shape, N, K, group_size, dtype): N not a multiple of 16 is padded for the int4 op
    ((3,), 200, 384, 64, torch.bfloat16),
    ((1,), 200, 384, 128, torch.bfloat16),
    ((2, 3), 16, 256, 32, torch.float32),
    ((2,), 7, 128, 32, torch.float16),
]


@pytest.mark.parametrize(("lead", "out_features", "in_features", "group_size", "dtype"), CPU_CASES)
def test_cpu_path_matches_reference(
    cpu_isa: str,
    lead: tuple[int, ...],
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(out_features)
    packed, scale = random_w4a16(out_features, in_features, group_size, gen)
    x = torch.randn(*lead, in_features, generator=gen).to(dtype)
    w = prepare_w4a16(packed, scale, group_size, backend="torch")
    assert w.cpu_isa == (None if cpu_isa == "torch" else cpu_isa)
    y = w4a16_linear(x, w)
    assert y.shape == (*lead, out_features) and y.dtype == dtype
    assert_close_rel(y, w4a16_reference(x, packed, scale, group_size), REL_TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bound_kernel_is_the_dispatched_call(cpu_isa: str, backend: str) -> None:
    """`w4a16_linear_of(w)`, the kernel an INT4 Linear holds from load on, gives `w4a16_linear`'s bits."""
    gen = torch.Generator().manual_seed(5)
    packed, scale = random_w4a16(72, 192, 64, gen)
    w = prepare_w4a16(packed, scale, 64, backend=backend)
    for num_rows in (1, 5):
        x = torch.randn(num_rows, 192, generator=gen).bfloat16()
        assert torch.equal(w4a16_linear_of(w)(x), w4a16_linear(x, w))
    stacked = prepare_w4a16(packed[None], scale[None], 64, backend=backend)
    with pytest.raises(ValueError, match="stacked experts"):
        w4a16_linear_of(stacked)


def test_cpu_weight_keeps_only_packed_bytes(cpu_isa: str) -> None:
    gen = torch.Generator().manual_seed(3)
    packed, scale = random_w4a16(64, 256, 64, gen)
    w = prepare_w4a16(packed, scale, 64, backend="torch")
    if cpu_isa != "torch":  # the native kernel reads the tensors as loaded
        assert w.layout == "native-cpu" and w.int4pack is None
        assert w.weight_packed is not None and torch.equal(w.weight_packed, packed)
        assert w.weight_scale is not None and torch.equal(w.weight_scale, scale)
        return
    assert w.weight_packed is None and w.layout == "int4pack-cpu"
    assert w.int4pack is not None and w.scales_and_zeros is not None
    assert w.int4pack.numel() * w.int4pack.element_size() == packed.numel() * 4
    assert torch.equal(w.scales_and_zeros[..., 1], torch.zeros(4, 64, dtype=torch.bfloat16))  # zero point 0


@pytest.mark.parametrize(
    ("packed", "scale", "group_size", "error"),
    [
        (torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, 2), 64, TypeError),
        (torch.zeros(8, 16, dtype=torch.int32), torch.ones(8, 3), 64, ValueError),
        (torch.zeros(8, 16, dtype=torch.int32), torch.ones(8, 8), 16, ValueError),
        (torch.zeros(8, 16, dtype=torch.int32), torch.ones(2, 8, 2), 64, ValueError),
    ],
)
def test_prepare_rejects_bad_tensors(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, error: type[Exception]
) -> None:
    with pytest.raises(error):
        prepare_w4a16(packed, scale, group_size, backend="torch")
