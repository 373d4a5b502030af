"""The output quantization_config: INT4 under `Linear`, kept FP8 by name, every dense Linear ignored."""

from __future__ import annotations

from compressed_tensors.quantization import QuantizationConfig

from kvq.compress.output_config import fp8_targets, quantization_config
from kvq.compress.recipe import load_recipe, matches_target
from kvq.compress.tensor_plan import build_plan, virtual_tensors

EXPERT = "model.layers.1.mlp.experts.0.up_proj"
ATTN = "model.layers.1.self_attn.o_proj"


def config_for(specs, recipe="w4a16-experts"):
    recipe = load_recipe(recipe)
    return quantization_config(recipe, build_plan(virtual_tensors(specs), recipe, (128, 128)))


def test_mixed_fp8_and_int4():
    qc = config_for(
        [
            (f"{EXPERT}.weight", "F8_E4M3", (256, 256)),
            (f"{EXPERT}.weight_scale_inv", "F32", (2, 2)),
            (f"{ATTN}.weight", "F8_E4M3", (256, 256)),
            (f"{ATTN}.weight_scale_inv", "F32", (2, 2)),
            ("model.layers.1.mlp.gate.weight", "BF16", (8, 256)),
            ("lm_head.weight", "BF16", (9, 256)),
        ]
    )
    parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k != "version"})
    assert parsed.format == "mixed-precision" and parsed.quantization_status == "compressed"
    int4, fp8 = parsed.config_groups["group_0"], parsed.config_groups["group_1"]
    assert int4.targets == ["Linear"] and int4.format == "pack-quantized" and int4.weights.group_size == 128
    assert fp8.targets == [r"re:^model\.layers\.1\.self_attn\.(o_proj)$"] and fp8.format == "float-quantized"
    assert fp8.weights.block_structure == [128, 128]
    assert fp8.input_activations.dynamic and fp8.input_activations.group_size == 128
    # dense Linears by name, plus the recipe's ignore entries (none of them matches a quantized module)
    assert "model.layers.1.mlp.gate" in parsed.ignore and "lm_head" in parsed.ignore
    assert ATTN not in parsed.ignore and EXPERT not in parsed.ignore


def test_bf16_only_int4_and_a_tied_head():
    qc = config_for(
        [
            (f"{EXPERT}.weight", "BF16", (256, 256)),
            ("model.layers.0.mlp.down_proj.weight", "BF16", (256, 576)),
        ],
        "w4a16-linear",
    )
    assert qc["format"] == "pack-quantized" and set(qc["config_groups"]) == {"group_0"}
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]  # in_features 576: kept at source precision
    assert "lm_head" in qc["ignore"]  # not stored (tied): must not be quantized by the `Linear` target


def test_fp8_targets_name_the_fused_layers_vllm_builds():
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    modules = [
        f"{attn}.q_a_proj",
        f"{attn}.kv_a_proj_with_mqa",
        f"{attn}.q_proj",
        f"{mlp}.gate_proj",
        f"{mlp}.up_proj",
        f"{mlp}.down_proj",
    ]
    targets = fp8_targets(modules)
    for name in [*modules, f"{attn}.fused_qkv_a_proj", f"{mlp}.gate_up_proj"]:
        assert any(matches_target(name, t) for t in targets), name
    for other in (f"{attn}.qkv_proj", f"{attn}.q_b_proj", "model.layers.10.mlp.up_proj"):  # q/k/v incomplete
        assert not any(matches_target(other, t) for t in targets), other


def test_a_calibrated_sources_kv_cache_scheme_is_kept():
    recipe = load_recipe("w4a16-experts")
    plan = build_plan(virtual_tensors([(f"{EXPERT}.weight", "BF16", (256, 256))]), recipe, (128, 128))
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    qc = quantization_config(recipe, plan, kv)
    assert {k: qc["kv_cache_scheme"][k] for k in kv} == kv
    assert quantization_config(recipe, plan)["kv_cache_scheme"] is None


def test_equals_compressed_tensors_own_dump():
    """The oracle: the library builds the same config from the same parts, and parses ours back unchanged."""
    from compressed_tensors import __version__
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    for recipe_name, specs in [
        ("w4a16-experts", [(f"{EXPERT}.weight", "BF16", (256, 256))]),
        (
            "w4a16-experts",
            [
                (f"{EXPERT}.weight", "F8_E4M3", (256, 256)),
                (f"{EXPERT}.weight_scale_inv", "F32", (2, 2)),
                (f"{ATTN}.weight", "F8_E4M3", (256, 192)),
                (f"{ATTN}.weight_scale_inv", "F32", (2, 2)),
            ],
        ),
    ]:
        recipe = load_recipe(recipe_name, group_size=64)
        plan = build_plan(virtual_tensors(specs), recipe, (128, 128))
        ours = quantization_config(recipe, plan, kv)
        groups = {
            "group_0": QuantizationScheme(
                targets=["Linear"], weights=QuantizationArgs(**recipe.weights_args()), format="pack-quantized"
            )
        }
        if plan.fp8_modules:
            groups["group_1"] = QuantizationScheme(
                targets=fp8_targets(plan.fp8_modules),
                weights=QuantizationArgs(
                    num_bits=8, type="float", strategy="block", block_structure=[128, 128], dynamic=False
                ),
                input_activations=QuantizationArgs(
                    num_bits=8, type="float", strategy="group", group_size=128, dynamic=True
                ),
                format="float-quantized",
            )
        library = QuantizationConfig(
            config_groups=groups,
            ignore=ours["ignore"],
            format=ours["format"],
            quantization_status="compressed",
            kv_cache_scheme=kv,
        ).model_dump(mode="json")
        assert ours == {"version": __version__, "transform_config": {}, **library}
        assert list(ours)[2:] == list(library)  # same key order: config.json reads like the library's
        parsed = QuantizationConfig.model_validate({k: v for k, v in ours.items() if k != "version"})
        assert parsed.model_dump(mode="json") == library
