"""DenseLinear on CPU bf16 off the amx path (there decode batches take kvq's AMX GEMM:
tests/runtime/kernels/test_dense_amx.py): one row goes through kvq's GEMV on every native path
(`gemv_dense`; torch's GEMM on the torch path), more rows through oneDNN on a blocked copy of the weight
made at the first batch (`prepack_cpu_bf16`); both equal the fp32 product within bf16 rounding, batches
equal F.linear bit for bit, and torch's oneDNN switch is never touched."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels.cpu.isa import CPU_ISA_ENV
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.layers.linear import FP8, DenseLinear, Fp8Linear, StoredLinear, prepack_cpu_bf16
from tests.runtime.cpu_isa import CPU_ISAS


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVQ_CPU_ISA=torch: the torch GEMMs whatever this CPU has."""
    monkeypatch.setenv(CPU_ISA_ENV, "torch")


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight.float())


@pytest.mark.parametrize("num_rows", [1, 3])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 96), (130, 576), (33, 1000)])
def test_dense_bf16_rows_equal_the_fp32_product(num_rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(out_features * in_features + num_rows)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    x = torch.randn(num_rows, in_features, generator=g).to(torch.bfloat16)
    layer = DenseLinear(weight, bias, CpuOps.choose())
    assert layer.is_cpu_bf16 and not layer.is_amx
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (num_rows, out_features)
    expected = _reference(x, weight) + bias.float()
    scale = expected.abs().max().item()
    assert (y.float() - expected).abs().max().item() <= 2e-2 * scale  # bf16 output rounding, K-long sums


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 96), (130, 577), (49, 1000)])
def test_one_row_is_kvqs_gemv_on_a_native_path(isa: str, out_features: int, in_features: int) -> None:
    """One bf16 row on a native path: kvq's GEMV (fp32 sums rounded once: within half a bf16 step of the
    fp32 product, but for the sums' own rounding), as one C call in a decode plan too; the torch path keeps
    torch's GEMM. oneDNN's switch stays as it was, on or off, and FP8 weights' rows take the same GEMV."""
    g = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(3, in_features, generator=g).to(torch.bfloat16)[1:2, :]  # a row of a batch
    layer = DenseLinear(weight, None, CpuOps.choose(isa))
    assert layer.gemv_isa == (None if isa == "torch" else isa)
    was = torch._C._get_mkldnn_enabled()
    for enabled in (True, False):
        torch._C._set_mkldnn_enabled(enabled)
        try:
            y = layer(x)
            assert torch._C._get_mkldnn_enabled() is enabled
        finally:
            torch._C._set_mkldnn_enabled(was)
        expected = _reference(x, weight)
        bound = expected.abs() * 2**-8 + 1e-5 * in_features * expected.abs().max()
        assert y.dtype == torch.bfloat16 and bool(((y.float() - expected).abs() <= bound).all())
    out = torch.empty(1, out_features, dtype=torch.bfloat16)
    call = layer.call(x.contiguous(), out)
    assert (call is None) == (isa == "torch")
    if call is not None:
        call[0](*call[1])
        assert torch.equal(out, y)
    scale = torch.ones(1, 1)
    fp8 = Fp8Linear(
        StoredLinear(FP8, {"weight": weight.to(torch.float8_e4m3fn), "weight_scale": scale}),
        None,
        CpuOps.choose(isa),
    )
    from_fp8 = weight.to(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(fp8(x), DenseLinear(from_fp8, None, CpuOps.choose(isa))(x))


def test_fp32_weights_take_f_linear_unchanged() -> None:
    weight, x = torch.randn(9, 16), torch.randn(1, 16)
    layer = DenseLinear(weight, None, CpuOps.choose())
    assert not layer.is_cpu_bf16
    assert torch.equal(layer(x), F.linear(x, weight))


@pytest.mark.skipif(prepack_cpu_bf16(torch.ones(4, 4, dtype=torch.bfloat16)) is None, reason="no oneDNN here")
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 96), (130, 576), (1000, 33)])
def test_batches_run_a_weight_blocked_once_and_equal_f_linear(out_features: int, in_features: int) -> None:
    # one thread: with two, oneDNN splits 65 rows differently over the blocked and the plain weight (a
    # bf16 ulp apart at [65, 576] x [130, 576]^T), whatever thread count the suite runs with
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_blocked_once(out_features, in_features)
    finally:
        torch.set_num_threads(was)


def _check_blocked_once(out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    layer = DenseLinear(weight, None, CpuOps.choose())
    y1 = layer(torch.randn(1, in_features, generator=g).to(torch.bfloat16))
    assert layer.packed is None and y1.shape == (1, out_features)  # batch 1: the plain weight only
    assert layer.tensors() == [weight]
    for num_rows in (2, 8, 65):
        x = torch.randn(num_rows, in_features, generator=g).to(torch.bfloat16)
        assert torch.equal(layer(x), F.linear(x, weight))
    packed = layer.packed
    assert packed is not None and layer.tensors() == [weight, packed]  # resident from the first batch on
    layer(torch.randn(3, in_features, generator=g).to(torch.bfloat16))
    assert layer.packed is packed  # blocked once


_AVX2_PROBE = """
import torch, torch.nn.functional as F
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.layers.linear import DenseLinear, onednn_prepack_available
weight = torch.randn(48, 64).bfloat16()
layer = DenseLinear(weight, None, CpuOps.choose())
x = torch.randn(4, 64).bfloat16()
print(onednn_prepack_available(), torch.equal(layer(x), F.linear(x, weight)), layer.packed is None)
"""


def test_batches_take_f_linear_where_onednn_has_no_bf16_path() -> None:
    """An AVX2-only CPU (here: oneDNN held to AVX2 by $ONEDNN_MAX_CPU_ISA) has no oneDNN bf16 blocking op:
    it raised there at the first batch (`kvq serve` on a BF16 checkpoint failed every batched step);
    batches take F.linear instead."""
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", _AVX2_PROBE]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True"]
