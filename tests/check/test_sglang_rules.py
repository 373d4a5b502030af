"""SGLang main's rules: the `sglang` target satisfies each of them (checked on the files themselves and by
`kvq check`), the `vllm` target of an FP8 source breaks them for the reasons SGLang PR #37207 lists, and
configs that break one rule at a time are reported with that rule."""

from __future__ import annotations

import json

import pytest

from kvq.check import check_checkpoint
from kvq.checkpoint.reader import Checkpoint
from tests.check.edit import errors, with_config

MOE = ["glm4_moe", "glm_moe_dsa"]


@pytest.mark.parametrize("fmt", ["fp8-block", "bf16"])
@pytest.mark.parametrize("arch", MOE)
def test_sglang_target_satisfies_every_rule(compressed, arch, fmt):
    out = compressed(arch, fmt, target="sglang")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    tensors = Checkpoint.open(out).tensors
    # CompressedTensorsWNA16MoE: the scheme under target `Linear`, symmetric, top-level pack-quantized
    assert list(qc["config_groups"]) == ["group_0"] and qc["format"] == "pack-quantized"
    group = qc["config_groups"]["group_0"]
    assert (
        group["targets"] == ["Linear"] and group["weights"]["symmetric"] and group["weights"]["num_bits"] == 4
    )
    # no FP8 left anywhere, so no `.weight_scale` the DSA indexer would miss as `.weight_scale_inv`
    assert not any(info.dtype == "F8_E4M3" for info in tensors.values())
    assert not any(".indexer." in n and n.endswith("weight_scale") for n in tensors)
    verdict = check_checkpoint(out, ["sglang"]).verdict("sglang")
    assert verdict.loads and not [f for f in verdict.findings if f.severity != "note"], verdict.findings
    moe = {name: s for name, s in verdict.schemes.items() if name.endswith("mlp.experts")}
    assert moe and set(moe.values()) == {"CompressedTensorsWNA16MoE"}
    assert verdict.schemes["model.layers.0.self_attn.o_proj"] == "unquantized"


@pytest.mark.parametrize("arch", MOE)
def test_vllm_target_of_an_fp8_source_is_not_loadable_by_sglang_main(compressed, arch):
    report = check_checkpoint(compressed(arch, "fp8-block"), ["sglang", "vllm"])
    assert report.loads("vllm") and not report.loads("sglang")
    found = errors(report.verdict("sglang"))
    # mixed-precision: the MoE needs a top-level pack-quantized, and FP8 groups get no scheme
    assert {"sglang.moe-format", "sglang.no-scheme"} <= found
    assert ("sglang.dsa-indexer-scale" in found) == (arch == "glm_moe_dsa")


def test_moe_scheme_is_looked_up_under_linear_only(compressed, tmp_path):
    def experts_by_regex(qc: dict) -> None:
        qc["config_groups"]["group_0"]["targets"] = [r"re:.*\.mlp\.(shared_)?experts.*"]

    out = with_config(compressed("glm4_moe", "bf16", target="sglang"), tmp_path / "m", experts_by_regex)
    report = check_checkpoint(out, ["sglang", "vllm"])
    assert "sglang.moe-linear-target" in errors(report.verdict("sglang"))
    assert report.loads("vllm")  # vLLM matches the experts by name


def test_asymmetric_int4_moe_is_refused(compressed, tmp_path):
    def asymmetric(qc: dict) -> None:
        qc["config_groups"]["group_0"]["weights"]["symmetric"] = False

    out = with_config(compressed("glm4_moe", "bf16", target="sglang"), tmp_path / "m", asymmetric)
    report = check_checkpoint(out, ["sglang", "vllm"])
    assert "sglang.moe-symmetric" in errors(report.verdict("sglang"))
    assert "vllm.zero-point" in errors(report.verdict("vllm"))  # vLLM would look for weight_zero_point


def test_a_fused_layer_partly_ignored_is_refused_by_both(compressed, tmp_path):
    def ignore_q_only(qc: dict) -> None:
        qc["ignore"].append("model.layers.0.self_attn.q_proj")

    out = with_config(compressed("llama", "bf16", "w4a16-linear"), tmp_path / "m", ignore_q_only)
    report = check_checkpoint(out, ["sglang", "vllm"])
    for engine in ("sglang", "vllm"):
        assert f"{engine}.scheme-lookup" in errors(report.verdict(engine)), engine
