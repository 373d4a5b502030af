"""kvq's GPTQ against llm-compressor's own `quantize_weight` (and `accumulate_hessian`) on the same inputs.

Random weights of odd shapes, Hessians from random activations with uneven column scales (so activation
order matters), dead columns; the codes must be identical, not close: the oracle on whole models
(test_oracle.py) rests on this.
"""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

from kvq.formats.pack_quantized import quantize_int4_group
from kvq.gptq.algorithm import HessianNotPositiveDefinite, gptq_quantize
from kvq.gptq.hessian import HessianSum


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    h = HessianSum(x.shape[-1])
    for row in x:
        h.add(row.unsqueeze(0))
    return h.normalized()


def reference_codes(
    weight, hessian, group_size, block_size, actorder, scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's GPTQ of `weight` (its scales from the observer it runs first: RTN's unless given)."""
    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, actorder=actorder
    )
    scale = quantize_int4_group(weight, group_size)[1] if scale is None else scale
    quantized, _loss, fallback = quantize_weight(
        weight.float().unsqueeze(0),
        hessian.clone().unsqueeze(0),  # quantize_weight overwrites its Hessian
        scale.unsqueeze(0),
        torch.zeros_like(scale, dtype=torch.int8).unsqueeze(0),
        None,
        args,
        blocksize=block_size,
        percdamp=0.01,
    )
    assert not fallback.any()
    step = scale.float().repeat_interleave(group_size, dim=1)
    return torch.round(quantized[0].to(weight.dtype).float() / step).clamp(-8, 7), scale


@pytest.mark.parametrize(
    "rows, cols, group_size, block_size, actorder",
    [(130, 192, 32, 128, "static"), (67, 320, 64, 64, None), (96, 256, 128, 96, "static")],
)
def test_codes_equal_llm_compressor(rows, cols, group_size, block_size, actorder) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16()
    x = torch.randn(6, 80, cols, generator=gen) * torch.rand(cols, generator=gen) * 4  # [samples, T, in]
    x[..., 5] = 0  # a dead column
    hessian = hessian_of(x.bfloat16())
    mine = gptq_quantize(
        weight, hessian, group_size=group_size, block_size=block_size, actorder=actorder is not None
    )
    codes, scale = reference_codes(weight, hessian, group_size, block_size, actorder)
    assert torch.equal(mine.weight_scale, scale)
    assert torch.equal(mine.codes.float(), codes)
    assert (mine.codes[:, 5] == 0).all()  # dead columns are zeroed, as llm-compressor does
    rtn = quantize_int4_group(weight, group_size)[0]
    assert not torch.equal(mine.codes, rtn)  # GPTQ moved codes: the test would see a no-op


def test_hessian_sum_equals_llm_compressor() -> None:
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(48, 8)
    mine = HessianSum(48)
    theirs, count = torch.zeros(48, 48), torch.zeros(())
    for x in (torch.randn(1, 33, 48, generator=gen), torch.randn(17, 48, generator=gen)):  # 3-D and 2-D
        mine.add(x.bfloat16())
        theirs, count = accumulate_hessian(x.bfloat16(), linear, theirs, count)
    assert mine.num_samples == int(count) == 2 and mine.num_tokens == 50
    assert torch.equal(mine.normalized(), theirs / count)


def test_singular_hessian_without_dampening_is_refused() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(16, 64, generator=gen).bfloat16()
    x = torch.randn(1, 8, 64, generator=gen)  # rank 8 < 64 columns: singular
    with pytest.raises(HessianNotPositiveDefinite):
        gptq_quantize(weight, hessian_of(x), group_size=32, dampening_frac=0.0)
    gptq_quantize(weight, hessian_of(x), group_size=32, dampening_frac=0.01)  # dampened: fine
