"""kvq's MSE observer against llm-compressor's (`observer: mse`), on SmolLM2's real weights, and GPTQ run with
its scales against llm-compressor's `quantize_weight` given the same scales.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.observers import Observer

from kvq.checkpoint.reader import Checkpoint
from kvq.formats.pack_quantized import quantize_int4_group
from kvq.gptq.algorithm import gptq_quantize
from kvq.gptq.observer import mse_weight_scale
from tests.gptq.test_algorithm import hessian_of, reference_codes

WEIGHTS = ("model.layers.0.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight")


def llm_compressor_mse_scale(weight: torch.Tensor, group_size: int, **observer_kwargs) -> torch.Tensor:
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=True,
        strategy="group",
        group_size=group_size,
        observer="mse",
        observer_kwargs=observer_kwargs,
    )
    observer = Observer.load_from_registry("mse", base_name="weight", args=args)
    return observer(weight).get_qparams()["scale"]


@pytest.mark.parametrize("group_size", [32, 64])  # SmolLM2 hidden size 576: 128 does not divide it
def test_mse_scales_equal_llm_compressor_on_smollm2(smollm2, group_size: int) -> None:
    ckpt = Checkpoint.open(smollm2.bf16)
    for name in WEIGHTS:
        weight = ckpt.read(name)  # [out, in] bf16
        mine = mse_weight_scale(weight, group_size)
        assert mine.dtype == torch.bfloat16
        assert torch.equal(mine, llm_compressor_mse_scale(weight, group_size)), name
        minmax = quantize_int4_group(weight, group_size)[1]
        assert (mine < minmax).float().mean() > 0.3, name  # the search shrank most groups: not a no-op
        assert (mine <= minmax).all(), name


@pytest.mark.parametrize(
    "observer_kwargs",
    [{"norm": 2.0}, {"maxshrink": 0.4, "patience": 3}, {"grid": 40.0, "expand": 1.25}],
)
def test_observer_kwargs_search_as_llm_compressor_does(smollm2, observer_kwargs: dict) -> None:
    """A recipe's `observer_kwargs` (norm, maxshrink, patience, grid, expand) steer kvq's search exactly as
    they steer llm-compressor's, and each moves the scales away from the default search's."""
    weight = Checkpoint.open(smollm2.bf16).read(WEIGHTS[1])
    mine = mse_weight_scale(weight, 64, **observer_kwargs)
    assert torch.equal(mine, llm_compressor_mse_scale(weight, 64, **observer_kwargs)), observer_kwargs
    assert not torch.equal(mine, mse_weight_scale(weight, 64)), observer_kwargs


def test_gptq_with_mse_scales_equals_llm_compressor() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(83, 192, generator=gen) * 0.02).bfloat16()
    x = torch.randn(4, 70, 192, generator=gen) * torch.rand(192, generator=gen) * 4  # [samples, T, in]
    hessian = hessian_of(x.bfloat16())
    mine = gptq_quantize(weight, hessian, group_size=64, observer="mse")
    scale = llm_compressor_mse_scale(weight, 64)
    codes, _ = reference_codes(weight, hessian, 64, 128, "static", scale)
    assert torch.equal(mine.weight_scale, scale)
    assert torch.equal(mine.codes.float(), codes)
    assert not torch.equal(mine.codes, gptq_quantize(weight, hessian, group_size=64).codes)
