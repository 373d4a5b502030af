"""kvq check on checkpoints kvq did not write: llm-compressor model_free_ptq's output, and a Kimi-K2-native
INT4 checkpoint (routed experts INT4 group 32 under `Linear`, attention and shared experts BF16)."""

from __future__ import annotations

import pytest

from kvq.check import check_checkpoint
from tests.check.edit import errors
from tests.check.kimi import build_kimi_int4


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return build_kimi_int4(tmp_path_factory.mktemp("kimi") / "model")


@pytest.mark.parametrize("tp", [1, 2])
def test_kimi_native_int4_loads_in_vllm_and_sglang(kimi, tp):
    report = check_checkpoint(kimi, ["vllm", "sglang", "transformers"], tp)
    vllm = report.verdict("vllm")
    assert vllm.loads, vllm.findings
    attn = "model.layers.1.self_attn"
    assert vllm.schemes[f"{attn}.fused_qkv_a_proj"] == "unquantized"  # re:.*self_attn.* ignores it
    assert vllm.schemes["model.layers.0.mlp.gate_up_proj"] == "unquantized"
    assert vllm.schemes["model.layers.1.mlp.shared_experts.down_proj"] == "unquantized"
    assert vllm.schemes["model.layers.1.mlp.experts"] == "CompressedTensorsWNA16MoEMethod"
    assert vllm.marlin_moe == {"model.layers.1.mlp.experts": True}  # 128 / tp % max(64, 32) == 0
    sglang = report.verdict("sglang")
    assert sglang.loads and sglang.schemes["model.layers.1.mlp.experts"] == "CompressedTensorsWNA16MoE"
    # shared experts BF16 beside INT4 routed experts: SGLang's fusion of the two must be off
    assert "sglang.shared-expert-fusion" in {f.rule for f in sglang.findings}
    transformers = report.verdict("transformers")
    assert transformers.loads  # kimi_k2 is remote code: a warning says trust_remote_code
    assert [f.rule for f in transformers.findings] == ["transformers.model-type"]


def test_kimi_native_int4_in_the_kvq_runtime(kimi):
    # kimi_k2 is the DeepSeek-V3 architecture: the runtime's registry runs it as deepseek_v3
    assert check_checkpoint(kimi, ["kvq"]).loads("kvq")


def test_model_free_ptq_output(model_free):
    # llm-compressor writes the recipe's own targets (expert regexes, no `Linear`) and BF16 attention
    report = check_checkpoint(model_free("glm4_moe", "fp8-block"))
    vllm = report.verdict("vllm")
    assert vllm.loads and vllm.schemes["model.layers.1.mlp.experts"] == "CompressedTensorsWNA16MoEMethod"
    assert vllm.schemes["model.layers.1.self_attn.qkv_proj"] == "unquantized"  # no target matches it
    assert report.loads("transformers") and report.loads("kvq")
    # SGLang main: the MoE scheme is looked up under `Linear` only, and a Linear no target matches raises
    assert {"sglang.moe-linear-target", "sglang.scheme-lookup"} <= errors(report.verdict("sglang"))
