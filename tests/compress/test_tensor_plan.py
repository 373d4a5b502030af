"""build_plan: what each stored tensor becomes, decided from names, dtypes and shapes; errors up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.checkpoint.header import TensorInfo
from kvq.compress.recipe import load_recipe
from kvq.compress.tensor_plan import (
    COPY,
    DEQUANTIZE,
    FP8_BLOCK,
    INT4,
    build_plan,
    is_linear_weight,
    virtual_tensors,
)
from kvq.errors import KvqError

EXPERT = "model.layers.1.mlp.experts.3.down_proj"
ATTN = "model.layers.1.self_attn.q_b_proj"
PARTIAL = "model.layers.1.self_attn.o_proj"


def fp8(name: str, shape: tuple[int, int], scale_shape: tuple[int, int] | None = None) -> list:
    rows, cols = shape
    scale_shape = scale_shape or (-(-rows // 128), -(-cols // 128))
    return [(f"{name}.weight", "F8_E4M3", shape), (f"{name}.weight_scale_inv", "F32", scale_shape)]


def plan_of(specs: list, recipe: str = "w4a16-experts", group_size: int | None = None, target: str = "vllm"):
    return build_plan(virtual_tensors(specs), load_recipe(recipe, group_size), (128, 128), target)


def test_actions_and_outputs():
    plan = plan_of(
        [
            *fp8(EXPERT, (256, 384)),
            *fp8(ATTN, (512, 256)),
            *fp8(PARTIAL, (256, 192)),
            ("model.layers.1.mlp.gate.weight", "BF16", (8, 256)),
            ("model.norm.weight", "BF16", (256,)),
            ("model.embed_tokens.weight", "BF16", (100, 256)),
        ]
    )
    tasks = {t.source.name: t for t in plan.tasks}
    expert = tasks[f"{EXPERT}.weight"]
    assert expert.action == INT4 and expert.scale_inv.name == f"{EXPERT}.weight_scale_inv"
    assert [(o.name, o.dtype, o.shape) for o in expert.outputs] == [
        (f"{EXPERT}.weight_packed", "I32", (256, 48)),
        (f"{EXPERT}.weight_scale", "BF16", (256, 3)),
        (f"{EXPERT}.weight_shape", "I64", (2,)),
    ]
    attn = tasks[f"{ATTN}.weight"]
    assert attn.action == FP8_BLOCK and [o.name for o in attn.outputs] == [
        f"{ATTN}.weight",
        f"{ATTN}.weight_scale",
    ]
    partial = tasks[f"{PARTIAL}.weight"]  # in_features 192: a partial FP8 block, written as BF16
    assert partial.action == DEQUANTIZE and partial.scale_inv.name == f"{PARTIAL}.weight_scale_inv"
    assert [(o.name, o.dtype, o.shape) for o in partial.outputs] == [
        (f"{PARTIAL}.weight", "BF16", (256, 192))
    ]
    assert [(d.name, d.shape) for d in plan.dequantized] == [(f"{PARTIAL}.weight", (256, 192))]
    assert "in_features 192 is not a multiple of the 128 FP8 block" in plan.dequantized[0].reason
    assert tasks["model.layers.1.mlp.gate.weight"].action == COPY
    assert plan.int4_modules == [EXPERT] and plan.fp8_modules == [ATTN]
    assert plan.dense_linear_modules == ["model.layers.1.mlp.gate", PARTIAL]
    assert not plan.kept and not plan.has_lm_head


def test_sglang_target_writes_every_fp8_weight_not_quantized_as_bf16():
    specs = [*fp8(EXPERT, (256, 384)), *fp8(ATTN, (512, 256)), *fp8(PARTIAL, (256, 192))]
    plan = plan_of(specs, target="sglang")
    actions = {t.source.name: t.action for t in plan.tasks}
    assert actions == {
        f"{EXPERT}.weight": INT4,
        f"{ATTN}.weight": DEQUANTIZE,
        f"{PARTIAL}.weight": DEQUANTIZE,
    }
    assert not plan.fp8_modules and plan.dense_linear_modules == [PARTIAL, ATTN]
    assert all("target sglang" in d.reason for d in plan.dequantized)
    with pytest.raises(KvqError, match="--target 'tgi' is not known; use one of vllm, sglang"):
        plan_of(specs, target="tgi")


def test_group_size_decides_what_is_kept():
    specs = [
        (f"{EXPERT}.weight", "BF16", (64, 96)),
        ("model.layers.0.mlp.down_proj.weight", "BF16", (64, 576)),
    ]
    plan = plan_of(specs, "w4a16-linear")
    assert not plan.int4_modules and [k.name for k in plan.kept] == [s[0] for s in sorted(specs)]
    assert "in_features 96 is not a multiple of group_size 128" in plan.kept[1].reason
    assert plan_of(specs, "w4a16-linear", 32).int4_modules == sorted(
        s[0].removesuffix(".weight") for s in specs
    )
    assert plan_of(specs, "w4a16-linear", 64).int4_modules == ["model.layers.0.mlp.down_proj"]


def test_bf16_scales_follow_the_source_dtype():
    plan = plan_of([(f"{EXPERT}.weight", "F16", (8, 128))])
    assert plan.tasks[0].outputs[1].dtype == "F16"


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([(f"{EXPERT}.weight", "F8_E4M3", (256, 384))], "has no 'model.*weight_scale_inv' in the checkpoint"),
        (fp8(EXPERT, (256, 384), (2, 2)), r"has shape \[2, 2\], expected \[2, 3\] for weight \[256, 384\]"),
        ([(f"{EXPERT}.weight_scale_inv", "F32", (2, 3))], "has no FP8 weight .* incomplete"),
        ([(f"{EXPERT}.weight_packed", "I32", (8, 16))], "already compressed-tensors output"),
        (
            [(f"{EXPERT}.weight", "F8_E4M3", (8, 128)), (f"{EXPERT}.weight_scale", "F32", (1, 1))],
            "already compressed",
        ),
        ([(f"{EXPERT}.weight", "F8_E5M2", (8, 128))], "F8_E5M2; kvq reads FP8 e4m3"),
    ],
)
def test_bad_checkpoints_are_rejected_before_any_work(specs, match):
    with pytest.raises(KvqError, match=match):
        plan_of(specs)


def test_linear_weights():
    assert is_linear_weight("model.layers.0.self_attn.q_proj.weight", (4, 4))
    assert is_linear_weight("lm_head.weight", (4, 4))
    assert not is_linear_weight("model.embed_tokens.weight", (4, 4))
    assert not is_linear_weight("model.layers.0.self_attn.kv_a_layernorm.weight", (4, 4))
    assert not is_linear_weight("model.layers.0.self_attn.q_proj.bias", (4,))


def test_virtual_tensors_are_laid_out_back_to_back():
    tensors = virtual_tensors([("a", "BF16", (2, 3)), ("b", "F32", (4,))])
    assert tensors["b"] == TensorInfo("b", Path("model.safetensors"), "F32", (4,), 12, 28)
