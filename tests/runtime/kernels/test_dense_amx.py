"""The dense BF16 GEMM on AMX tiles (`cpu.dense`, `_dense_cpu_amx.h`): the fp32 product of bf16 x and a bf16
weight within fp32 rounding, for batches 1..32 (A tiles straight from the weight's rows, pairs of strips and
a last strip), more rows (strip passes over a copy), irregular N, K one tile to several blocks, fp32 / bf16 /
fp16 outputs, two threads; `DenseLinear` taking it for decode batches where the path is amx, and the
shape errors. Skipped where this CPU or build has no amx path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvq.runtime.kernels.cpu.dense import DENSE_AMX_MAX_ROWS, dense_amx_applies, dense_amx_matmul
from kvq.runtime.kernels.cpu.isa import CPU_ISA_ENV
from kvq.runtime.kernels.cpu.linear import gemm_dense
from kvq.runtime.kernels.cpu.ops import CpuOps
from kvq.runtime.layers.linear import DenseLinear
from tests.runtime.cpu_isa import needs_amx
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel

pytestmark = needs_amx

# (N, K): N a multiple of 32 (pairs only), of 16 but not 32 (a last strip), of neither (rows past N);
# K one tile, several tiles, past a block of 128, SmolLM2's 576 and 1536
SHAPES = [(32, 32), (48, 96), (7, 64), (100, 576), (1000, 160), (3072 + 16, 576), (576, 1536)]
BATCHES = [1, 2, 15, 16, 17, 31, 32, 33, 64]  # 33, 64: the strip passes


def _random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("num_rows", BATCHES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_equals_the_fp32_product(num_rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(num_rows * 10_000 + out_features + in_features)
    weight, x = _random((out_features, in_features), gen), _random((num_rows, in_features), gen)
    y = torch.empty(num_rows, out_features)
    gemm_dense(x, weight, y)
    expected = x.float() @ weight.float().T  # bf16 products are exact in fp32: only the sums' order differs
    assert_close_rel(y, expected, REL_TOL[torch.float32])
    y_bf16 = torch.empty(num_rows, out_features, dtype=torch.bfloat16)
    gemm_dense(x, weight, y_bf16)
    assert torch.equal(y_bf16, y.to(torch.bfloat16))  # rounded once, to nearest even


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("threads", [1, 2])
def test_output_dtypes_and_threads(y_dtype: torch.dtype, threads: int) -> None:
    gen = torch.Generator().manual_seed(5)
    weight, x = _random((1000, 576), gen), _random((20, 576), gen)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = torch.empty(20, 1000, dtype=y_dtype)
        gemm_dense(x, weight, y)
    finally:
        torch.set_num_threads(was)
    reference = torch.empty(20, 1000)
    gemm_dense(x, weight, reference)
    assert torch.equal(y, reference.to(y_dtype))  # threads split whole strips: the same sums


def test_bad_shapes_are_refused() -> None:
    x, weight = torch.ones(2, 48, dtype=torch.bfloat16), torch.ones(4, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        gemm_dense(x, weight, torch.empty(2, 4))
    assert not dense_amx_applies(weight)  # the layer keeps its torch path for such a K
    assert not dense_amx_applies(torch.ones(4, 64))  # fp32 weight
    assert not dense_amx_applies(torch.ones(64, 4, dtype=torch.bfloat16).T)  # not contiguous


def test_dense_linear_takes_it_for_decode_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(11)
    weight, bias = _random((300, 576), gen), _random((300,), gen)
    layer = DenseLinear(weight, bias, CpuOps.choose())
    assert layer.is_amx
    for num_rows in (1, 8, DENSE_AMX_MAX_ROWS):
        x = _random((num_rows, 576), gen)
        assert torch.equal(layer.matmul(x), dense_amx_matmul(x, weight))
        y, expected = layer(x), F.linear(x.float(), weight.float(), bias.float())
        assert_close_rel(y, expected, REL_TOL[torch.bfloat16])
    assert layer.packed is None and layer.tensors() == [weight, bias]  # no blocked copy for decode batches
    x3 = _random((2, 3, 576), gen)  # leading dims other than one: F.linear's path
    assert torch.equal(layer.matmul(x3), F.linear(x3, weight))
    x = _random((DENSE_AMX_MAX_ROWS + 1, 576), gen)
    assert torch.equal(layer.matmul(x), F.linear(x, weight))  # more rows: oneDNN (prefill)
    monkeypatch.setenv(CPU_ISA_ENV, "avx512bf16")
    assert not DenseLinear(weight, bias, CpuOps.choose()).is_amx  # another path chosen: torch's GEMMs
