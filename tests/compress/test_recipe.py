"""Recipes: the shipped files parse (kvq and llm-compressor) and match what the issue says; bad ones fail."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvq.compress.recipe import RECIPES_DIR, Recipe, available_recipes, load_recipe
from kvq.errors import KvqError

NEVER_QUANTIZED = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.3.mlp.gate",
    "model.layers.78.eh_proj",
    "model.layers.3.self_attn.indexer.weights_proj",
    "model.layers.78.shared_head.head",
]


def test_shipped_recipes():
    assert {"w4a16-experts", "w4a16-linear", "w4a16-linear-gptq", "w4a16-linear-gptq-mse"} <= set(
        available_recipes()
    )


def test_experts_recipe_targets_routed_and_shared_experts_only():
    recipe = load_recipe("w4a16-experts")
    assert recipe.group_size == 128
    for module in ["model.layers.3.mlp.experts.255.down_proj", "model.layers.3.mlp.shared_experts.gate_proj"]:
        assert recipe.matches(module)
    for module in [
        *NEVER_QUANTIZED,
        "model.layers.3.self_attn.q_a_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.self_attn.indexer.wq_b",
    ]:
        assert not recipe.matches(module), module


def test_linear_recipe_targets_every_linear_but_lm_head_and_routers():
    recipe = load_recipe("w4a16-linear")
    for module in [
        "model.layers.3.self_attn.q_a_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.experts.7.up_proj",
        "model.layers.3.self_attn.indexer.weights_proj",
    ]:
        assert recipe.matches(module)
    for module in ["lm_head", "model.layers.3.mlp.gate", "model.embed_tokens"]:
        assert not recipe.matches(module)


def test_group_size_override():
    assert load_recipe("w4a16-experts", 32).group_size == 32
    with pytest.raises(KvqError, match="group size 96 is not supported; use one of 32, 64, 128"):
        load_recipe("w4a16-experts", 96)


def read_by_llm_compressor(name: str) -> tuple[Recipe, object]:
    """The built-in recipe `name`, and the one modifier llm-compressor reads from its file."""
    from llmcompressor.recipe import Recipe as LlmCompressorRecipe

    recipe = load_recipe(name)
    (modifier,) = LlmCompressorRecipe.create_instance(str(recipe.path)).modifiers
    return recipe, modifier


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16-experts", "w4a16-linear"])
def test_llm_compressor_reads_the_same_file(name):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe, modifier = read_by_llm_compressor(name)
    assert isinstance(modifier, QuantizationModifier)
    config = modifier.resolve_quantization_config()
    ours = recipe.quantization_config()
    assert config.config_groups["group_0"].targets == ours.config_groups["group_0"].targets
    # llm-compressor fills in its default weight observer (memoryless_minmax); the quantization is the same.
    theirs_args = config.config_groups["group_0"].weights.model_dump(exclude={"observer"})
    assert theirs_args == ours.config_groups["group_0"].weights.model_dump(exclude={"observer"})
    assert list(config.ignore) == list(ours.ignore)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return str(path)


BASE = (RECIPES_DIR / "w4a16-linear.yaml").read_text()
GPTQ = (RECIPES_DIR / "w4a16-linear-gptq.yaml").read_text()


def mse_with(line: str) -> str:
    """The GPTQ recipe with `observer: mse` and `line` in its weights."""
    return GPTQ.replace("dynamic: false", f"dynamic: false\n            observer: mse\n            {line}")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            BASE.replace("QuantizationModifier:", "AWQModifier:"),
            "runs only QuantizationModifier or GPTQModifier, not AWQModifier",
        ),
        (
            BASE.replace("QuantizationModifier:", "GPTQModifier:\n      offload_hessians: true"),
            "offload_hessians",
        ),
        (GPTQ.replace("actorder: static", "actorder: group"), r"actorder: 'group' is not supported"),
        (GPTQ.replace("dampening_frac: 0.01", "dampening_frac: -1"), "dampening_frac must be a number in"),
        (GPTQ.replace("block_size: 128", "block_size: 0"), "block_size must be a positive integer"),
        (BASE.replace("      ignore:", "      block_size: 64\n      ignore:"), r"key\(s\) block_size"),
        (
            BASE.replace("      ignore:", "      kv_cache_scheme: {num_bits: 8}\n      ignore:"),
            r"unknown recipe key\(s\) kv_cache_scheme",
        ),
        (
            BASE.replace("dynamic: false", "dynamic: false\n            mystery: 1"),
            r"weights: unknown recipe key\(s\) mystery",
        ),
        (BASE.replace("symmetric: true", "symmetric: false"), "symmetric: False is not supported"),
        (
            BASE.replace("dynamic: false", "dynamic: false\n            observer: mse"),
            r"observer: 'mse' is supported only in a GPTQModifier",
        ),
        (
            GPTQ.replace("dynamic: false", "dynamic: false\n            observer: mse_quant"),
            r"observer: 'mse_quant' is not supported; use minmax or mse",
        ),
        (
            GPTQ.replace("dynamic: false", "dynamic: false\n            observer_kwargs: {norm: 2}"),
            r"observer_kwargs: settings of the mse observer \(in a GPTQModifier\); 'minmax' takes none",
        ),
        (mse_with("observer_kwargs: {nrm: 2}"), r"observer_kwargs: 'nrm' is not a setting of the mse"),
        (mse_with("observer_kwargs: {maxshrink: 2}"), r"observer_kwargs.maxshrink must be in \(0, 1\]"),
        (
            mse_with("observer_kwargs: [2]"),
            r"observer_kwargs: expected a mapping",
        ),
        (BASE.replace("num_bits: 4", "num_bits: 8"), "num_bits: 8 is not supported"),
        (BASE.replace("group_size: 128", "group_size: 100"), "group size 100 is not supported"),
        (BASE.replace('targets: ["Linear"]', "targets: []"), "expected a list of module names"),
        ("quant_stage: [1, 2", "not valid YAML"),
        ("a: 1\nb: 2\n", "top level: expected exactly one stage"),
    ],
)
def test_bad_recipes_name_the_file_and_key(tmp_path, text, match):
    with pytest.raises(KvqError, match=match):
        load_recipe(write(tmp_path, text))


def test_gptq_modifier_recipe(tmp_path):
    recipe = load_recipe("w4a16-linear-gptq")
    assert recipe.gptq is not None and recipe.gptq.record() == {
        "block_size": 128,
        "dampening_frac": 0.01,
        "actorder": "static",
        "observer": "minmax",
    }
    assert recipe.targets == load_recipe("w4a16-linear").targets and recipe.group_size == 128
    assert load_recipe("w4a16-linear").gptq is None
    defaults = GPTQ.replace("      block_size: 128\n      dampening_frac: 0.01\n      actorder: static\n", "")
    assert load_recipe(write(tmp_path, defaults)).gptq == recipe.gptq  # llm-compressor's defaults
    none = load_recipe(write(tmp_path, GPTQ.replace("actorder: static", "actorder: null")))
    assert none.gptq is not None and none.gptq.actorder is None
    mse_text = GPTQ.replace("dynamic: false", "dynamic: false\n            observer: mse")
    mse = load_recipe(write(tmp_path, mse_text))
    assert mse.gptq == replace(recipe.gptq, observer="mse") and mse.targets == recipe.targets
    shipped = load_recipe("w4a16-linear-gptq-mse")
    assert shipped.gptq == mse.gptq and (shipped.targets, shipped.ignore) == (recipe.targets, recipe.ignore)
    tuned_text = mse_text.replace(
        "observer: mse", "observer: mse\n            observer_kwargs: {norm: 2.0, averaging_constant: 0.5}"
    )
    tuned = load_recipe(write(tmp_path, tuned_text))  # averaging one observation changes nothing: dropped
    assert tuned.gptq == replace(mse.gptq, observer_kwargs=(("norm", 2.0),))
    assert tuned.gptq.record()["observer_kwargs"] == {"norm": 2.0}
    assert "observer_kwargs" not in mse.gptq.record()  # unset: the identity of earlier jobs (they resume)
    weights = tuned.quantization_config().config_groups["group_0"].weights
    assert (weights.observer, weights.observer_kwargs) == ("mse", {"norm": 2.0})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16-linear-gptq", "w4a16-linear-gptq-mse"])
def test_llm_compressor_reads_the_gptq_recipe(name):
    from llmcompressor.modifiers.gptq import GPTQModifier

    recipe, modifier = read_by_llm_compressor(name)
    assert isinstance(modifier, GPTQModifier)
    assert (modifier.block_size, modifier.dampening_frac, modifier.actorder) == (128, 0.01, "static")
    config = modifier.resolve_quantization_config()
    assert config.config_groups["group_0"].weights.group_size == recipe.group_size
    observer = config.config_groups["group_0"].weights.observer  # llm-compressor's default: memoryless_minmax
    assert observer == {"minmax": "memoryless_minmax", "mse": "mse"}[recipe.gptq.observer]
    assert list(config.ignore) == list(recipe.ignore)


def test_scheme_form_is_accepted(tmp_path):
    text = (
        "s:\n  m:\n    QuantizationModifier:\n      scheme: W4A16\n      targets: [Linear]\n"
        "      ignore: [lm_head]\n"
    )
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.targets == ("Linear",) and recipe.group_size == 128 and not recipe.matches("lm_head")


def test_unknown_recipe_name_lists_the_known_ones():
    with pytest.raises(KvqError, match="recipe 'w8a8' is not known; use one of .*w4a16-experts"):
        load_recipe("w8a8")
