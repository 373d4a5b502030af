"""The C quantizer gives exactly the torch quantizer's bytes and compressed-tensors' own (the oracle), on
shapes, group sizes, block shapes and magnitudes beyond the fixtures; bad values are reported, not packed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq.compress import native
from kvq.compress.torch_quantize import quantize_rows

_int4 = native._int4


def test_the_extension_is_built() -> None:
    assert native.is_available(), "kvq.compress._int4 is not built: run `make venv` (or pip install -e .)"


def c_quantize(weight: torch.Tensor, scale_inv: torch.Tensor | None, group: int, block: tuple[int, int]):
    """(status, weight_packed, weight_scale) from the C quantizer, as tensors."""
    assert _int4 is not None
    rows, cols = weight.shape
    packed, scales = bytearray(rows * cols // 2), bytearray(rows * cols // group * 2)
    if scale_inv is None:
        args = (1, weight.view(torch.int16).numpy().tobytes(), b"", rows, cols, group, 0, 0)
    else:
        codes = weight.view(torch.uint8).numpy().tobytes()
        args = (0, codes, scale_inv.float().numpy().tobytes(), rows, cols, group, *block)
    status = _int4.quantize(*args, packed, scales)
    packed_t = torch.frombuffer(packed, dtype=torch.int32).reshape(rows, cols // 8)
    return status, packed_t, torch.frombuffer(scales, dtype=torch.bfloat16).reshape(rows, cols // group)


def assert_same_as_torch(weight, scale_inv, group, block) -> None:
    status, packed, scale = c_quantize(weight, scale_inv, group, block)
    expected_packed, expected_scale = quantize_rows(weight, scale_inv, group, block)
    assert status == 0
    assert torch.equal(packed, expected_packed)
    assert torch.equal(scale.view(torch.int16), expected_scale.view(torch.int16))


MAGNITUDES = {"normal": 0.05, "wide": 100.0, "tiny": 1e-30, "zero": 0.0}


@pytest.mark.parametrize("magnitude", MAGNITUDES)
@pytest.mark.parametrize("block", [(128, 128), (64, 64), (128, 96)], ids=str)  # 96: groups span blocks
@pytest.mark.parametrize(("shape", "group"), [((300, 576), 64), ((129, 2880), 32), ((1, 128), 128)])
def test_fp8_block_source(shape, group, block, magnitude) -> None:
    gen = torch.Generator().manual_seed(shape[0])
    dense = torch.randn(shape, generator=gen) * MAGNITUDES[magnitude]
    if magnitude == "wide":  # many binades, e4m3 subnormals and its largest values in one tensor
        dense *= torch.exp(torch.randn(shape, generator=gen) * 3)
    weight = dense.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_rows, scale_cols = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    scale_inv = torch.rand(scale_rows, scale_cols, generator=gen) * 0.01 + 1e-4
    assert_same_as_torch(weight, scale_inv, group, block)


@pytest.mark.parametrize("scale", [1e-39, 2.0**-133, 300.0], ids=["subnormal", "tiniest", "above-2^8"])
def test_fp8_extreme_block_scales(scale) -> None:
    weight = (torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 8).to(torch.float8_e4m3fn)
    assert_same_as_torch(weight, torch.full((1, 2), scale), 128, (128, 128))


@pytest.mark.parametrize("scale", [0.0123, -0.0123, 0.0], ids=["positive", "negative", "zero"])
def test_fp8_every_largest_code_of_a_group(scale) -> None:
    """The C kernel computes each (block scale, largest code) pair once: give every row its own."""
    gen = torch.Generator().manual_seed(7)
    top = torch.arange(127, dtype=torch.int64).repeat_interleave(2)[:, None]  # 254 rows: tops 0..126
    codes = (torch.rand(254, 256, generator=gen) * (top + 1)).long()  # magnitudes 0..top
    codes[:, 5] = top[:, 0]  # each row reaches its top
    codes |= torch.randint(0, 2, codes.shape, generator=gen) * 0x80  # either sign
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    scale_inv = torch.full((2, 2), scale)
    scale_inv[1, 1] = abs(scale) * 3
    for group in (32, 128):
        assert_same_as_torch(weight, scale_inv, group, (128, 128))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_bf16_source(group) -> None:
    gen = torch.Generator().manual_seed(group)
    weight = torch.randn(97, 384, generator=gen) * torch.exp(torch.randn(97, 384, generator=gen) * 4)
    weight[3, :group] = 0  # an all-zero group: its scale is bf16's eps
    weight[5, 7] = 3e38  # near bf16's largest finite value
    assert_same_as_torch(weight.bfloat16(), None, group, (128, 128))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    groups=st.integers(1, 4),
    group=st.sampled_from([32, 64, 128]),
    block=st.sampled_from([(128, 128), (16, 48), (32, 32)]),
    log_scale=st.floats(-40, 10),
    seed=st.integers(0, 2**16),
)
def test_random_fp8_weights(rows, groups, group, block, log_scale, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    cols = groups * group
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    weight = codes.view(torch.float8_e4m3fn)
    scale_shape = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.rand(scale_shape, generator=gen) * 10.0**log_scale + 1e-45
    assert_same_as_torch(weight, scale_inv, group, block)


def test_bad_values_give_a_status_not_bytes() -> None:
    weight = torch.randn(4, 128).to(torch.float8_e4m3fn)
    weight.view(torch.uint8)[2, 9] = 0xFF  # an e4m3fn NaN
    assert c_quantize(weight, torch.ones(1, 1), 64, (128, 128))[0] == 1
    assert (
        c_quantize(torch.randn(4, 128).to(torch.float8_e4m3fn), torch.full((1, 1), 3e38), 64, (128, 128))[0]
        == 1
    )
    dense = torch.randn(4, 128).bfloat16()
    dense[1, 2] = float("inf")
    assert c_quantize(dense, None, 64, (128, 128))[0] == 1


def test_shapes_that_do_not_fit_are_refused() -> None:
    assert _int4 is not None
    with pytest.raises(ValueError, match="buffer sizes"):
        _int4.quantize(1, b"\0" * 6, b"", 1, 128, 64, 0, 0, bytearray(64), bytearray(4))
    with pytest.raises(ValueError, match="bad shape"):
        _int4.quantize(1, b"\0" * 256, b"", 1, 128, 48, 0, 0, bytearray(64), bytearray(4))


def test_workers_import_no_torch() -> None:
    """The forkserver preloads shard_job; a C-quantized job then runs without torch (saves ~1 s a worker)."""
    code = "import sys, kvq.compress.shard_job, kvq.compress.pool; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    )


@pytest.mark.parametrize("source", ["bf16", "fp8-block"])
def test_equals_compressed_tensors_itself(source) -> None:
    """The oracle directly: the library's W4A16 quantize-and-pack of the same bf16 values."""
    from compressed_tensors.entrypoints.convert import FP8BlockDequantizer

    from tests.compress.oracle import library_quantize

    gen = torch.Generator().manual_seed(11)
    dense = torch.randn(96, 640, generator=gen) * torch.exp(torch.randn(96, 1, generator=gen))
    if source == "bf16":
        weight, scale_inv, bf16 = dense.bfloat16(), None, dense.bfloat16()
    else:
        weight = (dense * 20).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(1, 5, generator=gen) * 0.01 + 1e-3
        tensors = {"m.weight": weight, "m.weight_scale_inv": scale_inv}
        bf16 = FP8BlockDequantizer(targets=["m"]).process(tensors)["m.weight"]
    expected = library_quantize(bf16, 64)
    status, packed, scale = c_quantize(weight, scale_inv, 64, (128, 128))
    assert status == 0 and bf16.dtype == torch.bfloat16
    assert torch.equal(packed, expected["weight_packed"]) and torch.equal(scale, expected["weight_scale"])
