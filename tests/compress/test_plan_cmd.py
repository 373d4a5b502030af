"""`kvq plan`: from headers or a bare public config.json: per-kind sizes, exact output size, GPU memory.

data/: config.json of GLM-5.1 and DeepSeek-R1 as published, checked against their published tensor
listings; Kimi-K2-Instruct's architecture fields (model_type kimi_k2, 384 experts, FP8-block); Kimi K2.6's
native INT4 config (nested kimi_k25 / text_config; sources in data/SOURCES.md).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.checkpoint.reader import Checkpoint
from kvq.cli import build_app
from kvq.compress.source import open_source
from kvq.errors import KvqError

DATA = Path(__file__).parent / "data"
GiB = 2**30


app = build_app()


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{") :])


def test_plan_of_a_checkpoint_writes_nothing(tiny_checkpoint):
    src = tiny_checkpoint("glm_moe_dsa", "fp8-block")
    before = sorted(p.name for p in src.iterdir())
    result = CliRunner().invoke(app, ["plan", str(src), "--recipe", "w4a16-experts"], catch_exceptions=False)
    assert result.exit_code == 0
    for text in ("routed_experts", "shared_experts", "attention", "predicted", "54 Linears to INT4"):
        assert text in result.output
    assert sorted(p.name for p in src.iterdir()) == before


def test_plan_json_per_kind(tiny_checkpoint):
    plan = plan_json(str(tiny_checkpoint("glm4_moe", "bf16")), "--recipe", "w4a16-experts")["plan"]
    experts, attention = plan["kinds"]["routed_experts"], plan["kinds"]["attention"]
    # BF16 source: weight -> weight_packed + weight_scale + weight_shape, at about a quarter of the bytes.
    assert experts["tensors_after"] == 3 * experts["tensors_before"]
    assert experts["bytes_after"] < 0.27 * experts["bytes_before"]
    assert attention["bytes_after"] == attention["bytes_before"]
    assert plan["total"]["parameters"] == sum(k["parameters"] for k in plan["kinds"].values())


def test_plan_lists_fp8_weights_written_as_bf16(tiny_checkpoint):
    plan = plan_json(str(tiny_checkpoint("glm_moe_dsa", "fp8-block")), "--recipe", "w4a16-experts")["plan"]
    names = {d["name"] for d in plan["dequantized"]}  # q_lora 192 and the dense MLP's 576 are partial blocks
    assert (
        "model.layers.0.self_attn.q_b_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    )


def test_bare_config_matches_the_published_glm_5_1_checkpoint():
    # GLM-5.1 (BF16) as published: 59,870 tensors, 753,864,139,008 parameters, 1404.18 GiB of tensors.
    plan = plan_json(str(DATA / "glm-5.1-config.json"), "--recipe", "w4a16-experts")
    assert plan["is_bare_config"]
    total = plan["plan"]["total"]
    assert (total["tensors_before"], total["parameters"]) == (59870, 753_864_139_008)
    assert round(total["bytes_before"] / GiB, 2) == 1404.18


@pytest.mark.slow
def test_bare_config_matches_the_published_deepseek_r1_fp8_checkpoint():
    # DeepSeek-R1 (FP8-block; MTP layer 61 has its own embed_tokens and shared_head.head): 91,991 tensors,
    # 641.29 GiB.
    total = plan_json(str(DATA / "deepseek-r1-config.json"), "--recipe", "w4a16-experts")["plan"]["total"]
    assert total["tensors_before"] == 91991 and round(total["bytes_before"] / GiB, 2) == 641.29


def _glm5_fp8(tmp_path: Path) -> Path:
    config = json.loads((DATA / "glm-5.1-config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_glm5_fp8_plan_and_serving_memory(tmp_path):
    out = plan_json(str(_glm5_fp8(tmp_path)), "--recipe", "w4a16-experts", "--tp", "8", "--gpu-mem", "141GiB")
    plan, serving, source = out["plan"], out["serving"], out["serving_source"]
    assert round(plan["source_file_bytes"] / GiB) == 704  # the "705 GB" GLM-5-FP8
    assert 360 * GiB < plan["output_file_bytes"] < 380 * GiB
    assert plan["num_fp8_kept"] > 500 and not plan["kept"] and not plan["dequantized"]  # all 128-aligned
    by_target = out["output_file_bytes_by_target"]  # sglang: FP8 attention and dense MLPs as BF16
    assert by_target["vllm"] == plan["output_file_bytes"]
    assert by_target["vllm"] + 10 * GiB < by_target["sglang"] < by_target["vllm"] + 20 * GiB
    weights = serving["weights"]
    # The MTP layer (78) is not loaded; the rest is either on every GPU or split over 8.
    assert weights["replicated"] + weights["split"] + weights["mtp"] == plan["total"]["bytes_after"]
    assert 0.01 < weights["mtp"] / plan["total"]["bytes_after"] < 0.02
    assert serving["weight_bytes_per_gpu"] == weights["replicated"] + -(-weights["split"] // 8)
    # attention's a-projections stay FP8; the output adds only INT4 weight_shape records (16 B, replicated)
    assert 0 < weights["replicated"] - source["weights"]["replicated"] < 16 * plan["num_int4"] + 1
    bf16, fp8 = serving["kv"]
    assert (bf16["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("bf16", "fp8_e4m3")
    # MLA latent (576) in the KV dtype + the DSA indexer key (128) in bf16, 78 layers, on every GPU.
    assert (fp8["kv_bytes_per_token"], fp8["indexer_bytes_per_token"]) == (78 * 576, 78 * 128 * 2)
    assert bf16["bytes_per_token"] == 78 * (576 + 128) * 2
    budget = 141 * GiB - serving["weight_bytes_per_gpu"]
    assert serving["kv_budget_bytes"] == budget and fp8["tokens"] == budget // (78 * (576 + 256))


def test_kimi_k26_native_int4_config_plans_without_a_recipe():
    """Kimi K2.6 as published: nested kimi_k25 / text_config, compressed-tensors INT4 group 32."""
    out = plan_json(
        str(DATA / "kimi-k2.6-config.json"), "--tp", "8", "--gpu-mem", "141GB", "--mem-fraction", "0.88"
    )
    stored, serving = out["stored"], out["serving"]
    assert out["recipe"] is None and stored["format"] == "pack-quantized"
    # Kimi-K2.5's published listing (K2.6 keeps the layout): 208,550 tensors, 554.27 GiB, of which the
    # vision tower and projector, not derived from config.json, are 335 tensors.
    assert stored["total"]["tensors"] == 208550 - len(VISION_TOWER)
    vision_bytes = sum(math.prod(shape) * 2 for shape in VISION_TOWER.values())
    assert abs((stored["total"]["bytes"] + vision_bytes) / GiB - 554.27) < 0.01
    experts = stored["kinds"]["routed_experts"]
    assert experts["tensors"] == 60 * 384 * 3 * 3 and experts["dtypes"] == ["BF16", "I32", "I64"]
    assert stored["kinds"]["attention"]["dtypes"] == ["BF16"]  # attention stays BF16 (re:.*self_attn.*)
    assert "dense_mlp" in stored["kinds"] and stored["kinds"]["embeddings"]["tensors"] == 2
    bf16, fp8 = serving["kv"]
    assert (bf16["bytes_per_token"], fp8["bytes_per_token"]) == (61 * 576 * 2, 61 * 576)
    assert serving["weights"]["mtp"] == 0 and serving["mem_fraction"] == 0.88
    assert serving["kv_budget_bytes"] == int(0.88 * 141e9) - serving["weight_bytes_per_gpu"]
    assert fp8["tokens"] in (2 * bf16["tokens"], 2 * bf16["tokens"] + 1)
    assert 650_000 < bf16["tokens"] < 720_000  # the published ~686K (BF16) -> ~1.37M (FP8) on 8 x H200


# Kimi-K2.5's published vision_tower.* / mm_projector.* tensors (27 blocks), bf16.
_BLOCK = {
    "mlp.fc0.weight": (4304, 1152), "mlp.fc0.bias": (4304,), "mlp.fc1.weight": (1152, 4304),
    "mlp.fc1.bias": (1152,), "norm0.weight": (1152,), "norm0.bias": (1152,), "norm1.weight": (1152,),
    "norm1.bias": (1152,), "wo.weight": (1152, 1152), "wo.bias": (1152,), "wqkv.weight": (3456, 1152),
    "wqkv.bias": (3456,),
}  # fmt: skip
VISION_TOWER = {
    **{f"vision_tower.encoder.blocks.{i}.{k}": v for i in range(27) for k, v in _BLOCK.items()},
    "vision_tower.encoder.final_layernorm.weight": (1152,),
    "vision_tower.encoder.final_layernorm.bias": (1152,),
    "vision_tower.patch_embed.pos_emb.weight": (64, 64, 1152),
    "vision_tower.patch_embed.proj.weight": (1152, 3, 14, 14),
    "vision_tower.patch_embed.proj.bias": (1152,),
    "mm_projector.pre_norm.weight": (1152,),
    "mm_projector.pre_norm.bias": (1152,),
    "mm_projector.proj.0.weight": (4608, 4608),
    "mm_projector.proj.0.bias": (4608,),
    "mm_projector.proj.2.weight": (7168, 4608),
    "mm_projector.proj.2.bias": (7168,),
}


@pytest.mark.slow
def test_kimi_k26_tensors_match_the_published_listing_element_for_element():
    # The listing's parameter total counts stored elements (an int32 word of weight_packed as one).
    tensors = open_source(DATA / "kimi-k2.6-config.json").tensors
    vision = sum(math.prod(shape) for shape in VISION_TOWER.values())
    assert sum(math.prod(i.shape) for i in tensors.values()) + vision == 170_738_182_128
    packed = tensors["language_model.model.layers.1.mlp.experts.0.down_proj.weight_packed"]
    scale = tensors["language_model.model.layers.60.mlp.experts.383.gate_proj.weight_scale"]
    assert (packed.dtype, packed.shape, scale.dtype, scale.shape) == ("I32", (7168, 256), "BF16", (2048, 224))
    assert tensors["language_model.model.layers.0.mlp.down_proj.weight"].shape == (7168, 18432)
    assert tensors["language_model.lm_head.weight"].dtype == "BF16"


def test_plan_of_a_compressed_checkpoint_needs_no_recipe(tiny_checkpoint):
    root = tiny_checkpoint("deepseek_v3", "kimi-int4")
    out = plan_json(str(root), "--tp", "2", "--gpu-mem", "1GiB")
    stored, serving = out["stored"], out["serving"]
    assert stored["total"]["bytes"] == sum(i.nbytes for i in Checkpoint.open(root).tensors.values())
    assert "vision" in stored["kinds"] and stored["model"].startswith(
        "kimi_k25: text_config.model_type kimi_k2"
    )
    weights = serving["weights"]
    assert weights["replicated"] + weights["split"] == stored["total"]["bytes"]
    bf16, fp8 = serving["kv"]
    assert bf16["bytes_per_token"] == 3 * (128 + 64) * 2 and fp8["tokens"] >= 2 * bf16["tokens"]
    with pytest.raises(KvqError, match="already compressed .pack-quantized.*drop --recipe"):
        CliRunner().invoke(app, ["plan", str(root), "--recipe", "w4a16-experts"], catch_exceptions=False)


@pytest.mark.slow
def test_kimi_k2_model_type_is_planned_as_deepseek_v3():
    total = plan_json(str(DATA / "kimi-k2-config.json"), "--recipe", "w4a16-experts")["plan"]["total"]
    assert 1.02e12 < total["parameters"] < 1.03e12


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--recipe", "w4a16-linear", "--tp", "8"], "--tp and --gpu-mem go together"),
        (
            ["--recipe", "w4a16-linear", "--tp", "8", "--gpu-mem", "80 gigs"],
            "--gpu-mem: '80 gigs' is not a size",
        ),
        (
            ["--recipe", "w4a16-linear", "--tp", "8", "--gpu-mem", "80GB", "--mem-fraction", "1.5"],
            r"must be in \(0, 1\]",
        ),
        ([], "not compressed yet; pass --recipe"),
        (["--recipe", "w4a16-linear", "--kv-dtype", "fp8"], "drop --kv-dtype / --kv-cache-dtype"),
        (["--recipe", "w4a16-linear", "--kv-cache-dtype", "fp8_e4m3"], "every KV cache dtype side by side"),
    ],
)
def test_bad_serving_flags(tiny_checkpoint, args, match):
    with pytest.raises(KvqError, match=match):
        CliRunner().invoke(
            app, ["plan", str(tiny_checkpoint("llama", "bf16")), *args], catch_exceptions=False
        )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            {"topk_method": "group_limited_greedy"},
            "text_config.topk_method 'group_limited_greedy' is not implemented",
        ),
        ({"scoring_func": "softmax"}, "supported scoring_func: sigmoid"),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope'"),
        ({"model_type": "kimi_k3"}, "text_config.model_type 'kimi_k3'"),
    ],
)
def test_configs_kvq_cannot_handle_are_refused_by_name(tmp_path, edit, match):
    config = json.loads((DATA / "kimi-k2.6-config.json").read_text())
    config["text_config"].update(edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvqError, match=re.escape(match)):
        CliRunner().invoke(
            app, ["plan", str(tmp_path), "--tp", "8", "--gpu-mem", "141GB"], catch_exceptions=False
        )


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_plan_prints_kvq_pool_bytes_per_token_equal_to_the_runtime_pool(tiny_checkpoint, arch: str) -> None:
    """`kvq plan`'s bytes per token are what kvq's own pool measures in each mode: the server figure with
    --kv-integrity off (no stamp byte), and beside it, printed and in --json, the checked pool's with its
    slot stamps (`KvCacheBytes.kvq_total(is_checked=True)`, 8 bytes per layer more)."""
    from kvq.checkpoint.kv_cache_spec import kv_cache_bytes
    from kvq.runtime.config import EngineConfig
    from kvq.runtime.engine import Engine

    src = tiny_checkpoint(arch, "bf16")
    args = ["plan", str(src), "--recipe", "w4a16-linear", "--tp", "1", "--gpu-mem", "80GB"]
    printed = CliRunner().invoke(app, args, catch_exceptions=False, terminal_width=200).output
    out = plan_json(*args[1:])
    for fit in out["serving"]["kv"]:
        dtype = fit["kv_cache_dtype"]
        for mode, planned in (("off", fit["bytes_per_token"]), ("tags", fit["kvq_checked_bytes_per_token"])):
            config = EngineConfig(
                model=str(src),
                dtype="bfloat16",
                kv_cache_dtype=dtype,
                kv_memory="1MiB",
                threads=1,
                kv_integrity=mode,
            )
            engine = Engine(config)
            pool = engine.kv_pool
            num_slots = pool.page_size * (pool.num_pages + 1)  # the zero page included
            assert planned == kv_cache_bytes(engine.kv_spec, dtype).kvq_total(mode != "off"), (dtype, mode)
            assert pool.nbytes == planned * num_slots, (dtype, mode)
        assert fit["kvq_checked_bytes_per_token"] == fit["bytes_per_token"] + 8 * pool.num_layers
    rows = re.findall(r"kvq --kv-integrity tags/full\s*│\s*(\d+)\s*│\s*(\d+)", printed)
    checked = [fit["kvq_checked_bytes_per_token"] for fit in out["serving"]["kv"]]
    assert [int(source) for source, _ in rows] == checked
