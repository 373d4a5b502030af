"""`kvq plan`: from headers or a bare public config.json: per-kind sizes, exact output size, GPU memory.

data/: config.json of GLM-5.1 and DeepSeek-R1 as published, checked against their published tensor
listings; Kimi-K2-Instruct's architecture fields (model_type kimi_k2, 384 experts, FP8-block).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvq.cli import build_app

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


def test_glm5_fp8_plan_and_serving_memory(tmp_path):
    config = json.loads((DATA / "glm-5.1-config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = plan_json(
        str(tmp_path),
        "--recipe",
        "w4a16-experts",
        "--tp",
        "8",
        "--gpu-mem",
        "141GiB",
        "--kv-cache-dtype",
        "fp8_e4m3",
    )
    plan, serving = out["plan"], out["serving"]
    assert round(plan["source_file_bytes"] / GiB) == 704  # the "705 GB" GLM-5-FP8
    assert 360 * GiB < plan["output_file_bytes"] < 380 * GiB
    assert plan["num_fp8_kept"] > 500 and not plan["kept"] and not plan["dequantized"]  # all 128-aligned
    by_target = out["output_file_bytes_by_target"]  # sglang: FP8 attention and dense MLPs as BF16
    assert by_target["vllm"] == plan["output_file_bytes"]
    assert by_target["vllm"] + 10 * GiB < by_target["sglang"] < by_target["vllm"] + 20 * GiB
    assert serving["weight_bytes_per_gpu"] == -(-plan["total"]["bytes_after"] // 8)
    assert serving["kv_bytes_per_token_per_gpu"] == 78 * (512 + 64 + 128)  # MLA latent + DSA indexer key, fp8
    assert serving["kv_tokens"] == (141 * GiB - serving["weight_bytes_per_gpu"]) // (78 * 704)


@pytest.mark.slow
def test_kimi_k2_model_type_is_planned_as_deepseek_v3():
    total = plan_json(str(DATA / "kimi-k2-config.json"), "--recipe", "w4a16-experts")["plan"]["total"]
    assert 1.02e12 < total["parameters"] < 1.03e12


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--tp", "8"], "--tp and --gpu-mem go together"),
        (["--tp", "8", "--gpu-mem", "80 gigs"], "--gpu-mem: '80 gigs' is not a size"),
        (["--tp", "8", "--gpu-mem", "80GB", "--kv-cache-dtype", "int8"], "--kv-cache-dtype 'int8'"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype 'fp8': the name is now 'fp8_e4m3'"),
        (["--kv-dtype", "fp8"], "--kv-dtype is now --kv-cache-dtype"),
    ],
)
def test_bad_serving_flags(tiny_checkpoint, args, match):
    from kvq.errors import KvqError

    with pytest.raises(KvqError, match=match):
        CliRunner().invoke(
            app,
            ["plan", str(tiny_checkpoint("llama", "bf16")), "--recipe", "w4a16-linear", *args],
            catch_exceptions=False,
        )
