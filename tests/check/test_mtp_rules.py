"""kvq check's MTP verdict: kvq's output of a GLM-5-shaped FP8-block fixture with an MTP layer loads for
speculation in vLLM and SGLang; the broken releases seen in the wild are named by rule."""

from __future__ import annotations

import json

import pytest

from kvq.check import check_checkpoint
from tests.check.bad_mtp import (
    edit_ignore,
    mtp_entries_by_name,
    mtp_shard_not_indexed,
    whole_mtp_layer_ignored,
)

MTP_LAYER = 3  # the tiny MLA fixtures have 3 decoder layers


def _mtp_errors(verdict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in verdict.mtp_findings:
        if f.severity == "error":
            out.setdefault(f.rule, set()).add(f.where)
    return out


@pytest.mark.parametrize("target", ["vllm", "sglang"])
def test_kvq_output_loads_for_speculation(compressed, target: str) -> None:
    out = compressed("glm_moe_dsa", "fp8-block", target=target, num_mtp_layers=1)
    report = check_checkpoint(out, ["vllm", "sglang"])
    verdict = report.verdict(target)
    assert verdict.loads and verdict.loads_mtp is True and verdict.num_mtp_layers == 1
    assert verdict.mtp_findings == []
    moe = "model.layers.3.mlp.experts" if target == "vllm" else "model.decoder.mlp.experts"
    expected = {"vllm": "CompressedTensorsWNA16MoEMethod", "sglang": "CompressedTensorsWNA16MoE"}[target]
    assert verdict.schemes[moe] == expected  # the MTP experts are INT4 like the main ones
    assert f"{target} (tp 1): loads" in report.lines()
    assert "  MTP speculation (1 layer(s)): loads" in report.lines()
    assert report.to_json()["engines"][0]["loads_mtp"] is (target == "vllm" or report.loads("vllm"))


def test_a_checkpoint_without_mtp_gets_no_mtp_verdict(compressed) -> None:
    verdict = check_checkpoint(compressed("glm_moe_dsa", "fp8-block"), ["vllm"]).verdict("vllm")
    assert verdict.loads_mtp is None and verdict.num_mtp_layers == 0


def test_the_index_lists_every_mtp_tensor_and_ignore_describes_the_mtp_layer(compressed) -> None:
    out = compressed("glm_moe_dsa", "fp8-block", target="sglang", num_mtp_layers=1)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = {n for n in index if n.startswith("model.layers.3.")}
    assert {
        "model.layers.3.eh_proj.weight",
        "model.layers.3.enorm.weight",
        "model.layers.3.hnorm.weight",
    } <= mtp
    assert "model.layers.3.shared_head.norm.weight" in mtp
    assert {f"model.layers.3.mlp.experts.{e}.down_proj.weight_packed" for e in range(8)} <= mtp
    assert "model.layers.3.self_attn.o_proj.weight" in mtp  # sglang target: attention BF16
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert (
        r"re:^model\.(layers\.3|decoder)\.self_attn\.(kv_a_proj_with_mqa|kv_b_proj|o_proj|q_a_proj|q_b_proj)$"
        in ignore
    )
    assert not any(entry.startswith("model.layers.3.") for entry in ignore)


def test_mtp_shard_missing_from_the_index_is_named(compressed, tmp_path) -> None:
    src = compressed("glm_moe_dsa", "fp8-block", target="sglang", num_mtp_layers=1)
    broken = mtp_shard_not_indexed(src, tmp_path / "m", MTP_LAYER)
    report = check_checkpoint(broken, ["vllm", "sglang"])
    for engine in ("vllm", "sglang"):
        verdict = report.verdict(engine)
        assert verdict.loads and verdict.loads_mtp is False  # the main model still loads
        assert _mtp_errors(verdict) == {f"{engine}.mtp-missing": {"model.layers.3"}}
        message = verdict.mtp_findings[0].message
        assert "its tensors are in model-mtp.safetensors, which the index does not list" in message
    assert "  error [vllm.mtp-missing] model.layers.3: config.json declares num_nextn_predict_layers 1" in (
        "\n".join(report.lines())
    )


def test_ignore_list_contradicting_the_quantized_mtp_layer_is_named(compressed, tmp_path) -> None:
    src = compressed("glm_moe_dsa", "fp8-block", target="sglang", num_mtp_layers=1)
    broken = edit_ignore(src, tmp_path / "m", whole_mtp_layer_ignored(MTP_LAYER))
    verdict = check_checkpoint(broken, ["vllm"]).verdict("vllm")
    assert verdict.loads and verdict.loads_mtp is False
    errors = _mtp_errors(verdict)
    # ignore says BF16, the INT4 experts and shared experts say otherwise
    assert errors["vllm.mtp-moe-stored-form"] == {
        f"model.layers.3.mlp.experts.{e}.{p}_proj" for e in range(8) for p in ("gate", "up", "down")
    }
    assert errors["vllm.mtp-stored-form"] == {
        f"model.layers.3.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")
    }
    messages = {f.rule: f.message for f in verdict.mtp_findings}
    assert (
        "stored as int4 (group 128); the MoE layer loads dense experts"
        in messages["vllm.mtp-moe-stored-form"]
    )
    assert "resolves it to unquantized, which loads dense tensors" in messages["vllm.mtp-stored-form"]


def test_by_name_mtp_ignore_entries_miss_sglangs_nextn_decoder(compressed, tmp_path) -> None:
    src = compressed("glm_moe_dsa", "fp8-block", target="sglang", num_mtp_layers=1)
    broken = edit_ignore(src, tmp_path / "m", mtp_entries_by_name)
    ignore = json.loads((broken / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.3.self_attn.o_proj" in ignore
    report = check_checkpoint(broken, ["vllm", "sglang"])
    assert report.verdict("vllm").loads_mtp is True  # vLLM names the MTP layer as the checkpoint does
    sglang = report.verdict("sglang")
    assert sglang.loads and sglang.loads_mtp is False
    attention = (
        "kv_b_proj",
        "o_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "q_a_proj",
        "indexer.wk",
        "indexer.wq_b",
    )
    assert _mtp_errors(sglang)["sglang.mtp-stored-form"] == {
        f"model.layers.3.self_attn.{m}" for m in attention
    }
    assert "(the MTP decoder layer as python/sglang/srt/models/deepseek_nextn.py names it)" in (
        sglang.mtp_findings[0].message
    )
