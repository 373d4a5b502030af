"""Fused MoE over INT4 experts: block alignment invariants, and both backends against the reference."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from kvq.runtime.kernels import fused_moe_reference, fused_moe_w4a16, prepare_w4a16, w4a16_linear
from kvq.runtime.kernels.cpu.w4a8 import NativeW4A8, w4a8_path
from kvq.runtime.kernels.triton.fused_moe import moe_align_block_size
from kvq.runtime.kernels.w4a16 import LAYOUT_W4A8_CPU
from tests.runtime.kernels.kernel_cases import REL_TOL, assert_close_rel, case_id, random_w4a16


class MoeCase(NamedTuple):
    num_tokens: int
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    group_size: int
    dtype: torch.dtype

    def inputs(self, seed: int) -> tuple[torch.Tensor, ...]:
        """(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale), random from `seed`."""
        num_tokens, num_experts, hidden, intermediate, top_k, group_size, dtype = self
        gen = torch.Generator().manual_seed(seed)
        w13_packed, w13_scale = random_w4a16(2 * intermediate, hidden, group_size, gen, num_experts)
        w2_packed, w2_scale = random_w4a16(hidden, intermediate, group_size, gen, num_experts)
        x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
        topk_ids = torch.stack(
            [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
        )
        topk_weights = torch.rand(num_tokens, top_k, generator=gen)
        return x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale


# decode (1 token) and prefill-like token counts, experts unused and repeated
MOE_CASES = [
    MoeCase(5, 6, 192, 64, 2, 32, torch.float16),
    MoeCase(1, 4, 128, 128, 3, 64, torch.bfloat16),
    MoeCase(9, 3, 256, 96, 2, 32, torch.float32),
    MoeCase(4, 5, 256, 128, 2, 128, torch.float16),  # nibble planes
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case", MOE_CASES, ids=case_id)
def test_fused_moe_matches_reference(backend: str, case: MoeCase) -> None:
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale = case.inputs(seed=case.num_tokens)
    w13 = prepare_w4a16(w13_packed, w13_scale, case.group_size, backend=backend)
    w2 = prepare_w4a16(w2_packed, w2_scale, case.group_size, backend=backend)
    y = fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)
    assert y.dtype == case.dtype
    expected = fused_moe_reference(
        x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, case.group_size
    )
    assert_close_rel(y, expected, REL_TOL[case.dtype])


def test_fused_moe_with_an_expert_spanning_several_blocks() -> None:
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale = MoeCase(
        20, 8, 128, 64, 2, 64, torch.float16
    ).inputs(seed=6)
    topk_ids[:, 0] = 0  # expert 0 gets all 20 tokens: two 16-row blocks
    topk_ids[:, 1] = torch.randint(1, 8, (20,), generator=torch.Generator().manual_seed(6))
    w13 = prepare_w4a16(w13_packed, w13_scale, 64, backend="triton")
    w2 = prepare_w4a16(w2_packed, w2_scale, 64, backend="triton")
    y = fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)
    expected = fused_moe_reference(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, 64)
    assert_close_rel(y, expected, REL_TOL[torch.float16])


def test_moe_align_block_size_groups_pairs_by_expert() -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, top_k, num_experts, block_m = 7, 3, 5, 4
    topk_ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=gen)  # expert 4 unused
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    flat = topk_ids.reshape(-1)
    blocks = sorted_ids.view(-1, block_m)
    assert blocks.shape[0] == expert_ids.numel()
    seen = []
    for block, expert in zip(blocks.tolist(), expert_ids.tolist(), strict=True):
        pairs = [p for p in block if p < num_pairs]
        if expert < 0:
            assert not pairs
            continue
        assert pairs and all(flat[p] == expert for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(num_pairs))
    assert 4 not in expert_ids.tolist()


def test_fused_moe_rejects_mismatched_experts() -> None:
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale = MoeCase(
        2, 3, 128, 64, 2, 32, torch.bfloat16
    ).inputs(seed=5)
    w13 = prepare_w4a16(w13_packed, w13_scale, 32, backend="torch")
    w2 = prepare_w4a16(w2_packed[:2], w2_scale[:2], 32, backend="torch")
    with pytest.raises(ValueError, match="same E"):
        fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)


@pytest.mark.skipif(w4a8_path() is None, reason="int4_compute w4a8 needs AVX2 and kvq's CPU extension")
@pytest.mark.parametrize("case", MOE_CASES, ids=case_id)
def test_w4a8_experts_are_each_experts_w4a8_product(case: MoeCase) -> None:
    """Stacked experts in the W4A8 layout (int4_compute "w4a8"): each expert's call is that expert's own
    W4A8 kernel, bit for bit, and the MoE within int8 rounding of the reference."""
    num_experts, group_size, dtype = case.num_experts, case.group_size, case.dtype
    x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale = case.inputs(case.num_tokens + 7)
    w13 = prepare_w4a16(w13_packed, w13_scale, group_size, int8_activations=True)
    w2 = prepare_w4a16(w2_packed, w2_scale, group_size, int8_activations=True)
    assert w13.layout == w2.layout == LAYOUT_W4A8_CPU and w13.native.num_experts == num_experts
    assert w13.weight_packed is None  # the W4A8 layout replaces the loaded one
    for e in range(num_experts):
        alone = NativeW4A8(w13_packed[e], w13_scale[e], group_size)
        assert torch.equal(w13.native(x, e), alone(x))
    with pytest.raises(ValueError, match="stacked experts"):
        w4a16_linear(x, w13)
    y = fused_moe_w4a16(x, topk_ids, topk_weights, w13, w2)
    assert y.dtype == dtype
    expected = fused_moe_reference(
        x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size
    ).double()
    # two int8 roundings of the activations (x, then the SiLU product): ~1% of the output's norm
    assert (y.double() - expected).norm() / expected.norm() < 0.02
