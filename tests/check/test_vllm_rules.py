"""vLLM's rules as kvq check encodes them, on kvq's outputs (the same answers are checked against vLLM
itself by tests/test_vllm_check.py in `make test-vllm`): the Marlin MoE answer per group size and --tp,
the per-rank divisibility of INT4 groups and FP8 blocks, and one scheme per fused layer."""

from __future__ import annotations

import pytest

from kvq.check import check_checkpoint
from tests.check.edit import errors, with_config

# tiny glm4_moe: hidden 256, moe_intermediate 128 -> per rank 128 / tp; Marlin needs % max(64, group)
MARLIN = {(32, 2): True, (64, 2): True, (64, 4): False, (128, 1): True, (128, 2): False}


@pytest.mark.parametrize(("group_size", "tp"), list(MARLIN))
def test_marlin_moe_per_group_size_and_tp(compressed, group_size, tp):
    verdict = check_checkpoint(compressed("glm4_moe", "bf16", group_size=group_size), ["vllm"], tp).verdict(
        "vllm"
    )
    assert set(verdict.marlin_moe) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.experts"}
    assert set(verdict.marlin_moe.values()) == {MARLIN[group_size, tp]}
    assert ("vllm.marlin-moe" in {f.rule for f in verdict.findings}) == (not MARLIN[group_size, tp])
    assert set(v for k, v in verdict.schemes.items() if k.endswith("experts")) == {
        "CompressedTensorsWNA16MoEMethod"
    }


def test_int4_groups_and_fp8_blocks_per_tp_rank(compressed):
    out = compressed("glm4_moe", "fp8-block")  # vllm target: FP8-block attention, INT4 shared experts
    assert check_checkpoint(out, ["vllm"], 1).loads("vllm")
    tp2 = check_checkpoint(out, ["vllm"], 2).verdict("vllm")
    # shared_experts.down_proj: in 128 / 2 = 64, not whole groups of 128; k_proj: out 128 / 2 = 64 rows
    assert {f.where for f in tp2.findings if f.rule == "vllm.wna16-tp-group"} == {
        "model.layers.1.mlp.shared_experts.down_proj",
        "model.layers.2.mlp.shared_experts.down_proj",
    }
    fp8 = [f for f in tp2.findings if f.rule == "vllm.fp8-block-tp"]
    assert {f.where for f in fp8} == {f"model.layers.{i}.self_attn.qkv_proj" for i in range(3)}
    assert "output_partition_size 64 is not divisible by block_n 128" in fp8[0].message


def test_fused_parts_must_share_one_scheme(compressed, tmp_path):
    def q_only(qc: dict) -> None:  # layer 0: group_1 names q_proj, but not the fused qkv_proj nor k/v
        targets = qc["config_groups"]["group_1"]["targets"]
        layer0 = next(t for t in targets if t.startswith(r"re:^model\.layers\.0\.self_attn"))
        targets[targets.index(layer0)] = r"re:^model\.layers\.0\.self_attn\.(q_proj|o_proj)$"

    out = with_config(compressed("glm4_moe", "fp8-block"), tmp_path / "m", q_only)
    verdict = check_checkpoint(out, ["vllm"]).verdict("vllm")
    assert {"vllm.fused-scheme-equal", "vllm.stored-form"} <= errors(verdict)
    # qkv_proj: its parts do not all match a target by name (k, v do not), so the class target `Linear`
    # gives it INT4; q_proj alone would be FP8. All three are stored FP8, not the INT4 the layer loads.
    attn = "model.layers.0.self_attn"
    assert verdict.schemes[f"{attn}.qkv_proj"] == "CompressedTensorsWNA16"
    assert {f.where for f in verdict.findings if f.rule == "vllm.fused-scheme-equal"} == {f"{attn}.q_proj"}
    assert {f.where for f in verdict.findings if f.rule == "vllm.stored-form"} == {
        f"{attn}.{p}_proj" for p in "qkv"
    }
