"""GPTQ on the glm4_moe fixture: per-expert Hessians, RTN fallback below the token threshold, the output
loading in transformers and in the kvq runtime, and llm-compressor oneshot as the oracle for the experts.

The end-to-end run is the command line itself (a subprocess measured like `kvq bench`): its peak memory
must stay under the bound it prints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.checkpoint.reader import INDEX_NAME, Checkpoint, read_json
from kvq.compress.recipe import load_recipe
from kvq.compress.runner import prepare, run
from kvq.formats.pack_quantized import unpack_int4
from kvq.gptq.experts import route
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import prepare_gptq, run_gptq
from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from tests.compress.test_transformers_load import assert_holds_kvqs_weights, generate, load
from tests.conftest import TinyCheckpoint
from tests.gptq.test_gptaq import compress_within_printed_bound
from tests.gptq.test_oracle import oneshot_gptq
from tests.runtime.reference import engine_greedy, hf_greedy, hf_reference

SAMPLES = ["--num-samples", "10", "--seq-len", "64"]


def test_route_orders_tokens_as_transformers_does() -> None:
    top_k_index = torch.rand(50, 8, generator=torch.Generator().manual_seed(0)).topk(2).indices  # [T, k]
    routed = route(top_k_index, 8)
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=8).permute(2, 1, 0)  # [E, k, T]
    for e in range(8):
        _slot, tokens = torch.where(mask[e])  # what Glm4MoeExperts.forward and llm-compressor visit
        assert torch.equal(routed.order[routed.offsets[e] : routed.offsets[e + 1]], tokens)


@pytest.mark.slow
def test_every_expert_gptq_or_listed_and_the_output_serves(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src, out = tiny_checkpoint("glm4_moe", "bf16"), tmp_path / "gptq"
    args = ["--group-size", "64", "--method", "gptq", *SAMPLES, "--moe-min-tokens", "100"]
    compress_within_printed_bound(src, out, "w4a16-experts", *args)

    rtn = tmp_path / "rtn"
    job = prepare(src, rtn, load_recipe("w4a16-experts", 64))
    run(job, 2)
    manifest = read_json(out / "kvq_manifest.json", "manifest")
    modules = {m: r for layer in manifest["gptq"]["layers"].values() for m, r in layer["modules"].items()}
    fallback = {f["name"]: f["reason"] for f in manifest["gptq"]["rtn_fallback"]}
    assert set(modules) == set(job.plan.int4_modules)  # every INT4 module is accounted for, by layer
    assert set(fallback) == {m for m, r in modules.items() if r["method"] == "rtn"}
    gptq = {m for m, r in modules.items() if r["method"] == "gptq"}
    assert gptq and fallback and manifest["gptq"]["num_gptq"] == len(gptq)
    assert all(
        modules[m]["routed_tokens"] < 100 and "fewer than --moe-min-tokens 100" in fallback[m]
        for m in fallback
    )
    assert all(modules[m]["routed_tokens"] >= 100 for m in gptq if ".experts." in m)

    mine, reference = Checkpoint.open(out), Checkpoint.open(rtn)
    index = read_json(out / INDEX_NAME, "index")["weight_map"]
    assert index == read_json(rtn / INDEX_NAME, "index")["weight_map"]  # same tensors in the same shards
    for name in reference.tensors:
        module = name.rpartition(".")[0]
        if module in gptq and name.endswith("weight_packed"):
            assert not torch.equal(mine.read(name), reference.read(name)), name
        else:  # everything else is round-to-nearest's bytes: fallbacks, scales, copies
            assert torch.equal(mine.read(name), reference.read(name)), name
    assert read_json(out / "config.json", "config") == read_json(rtn / "config.json", "config")

    model = load(out)  # transformers + compressed-tensors
    assert_holds_kvqs_weights(model, out)
    generate(model)
    prompts = [[1, *range(40, 60)], [1, 7, 8, 9]]
    hf = hf_reference(out)
    engine = Engine(EngineConfig(model=str(out), dtype="float32", kv_memory="16MiB"))
    assert engine_greedy(engine, prompts, 24) == [hf_greedy(hf, p, 24) for p in prompts]


@pytest.mark.slow
def test_experts_match_oneshot_calibrating_all_experts(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """llm-compressor's default routes every token through every expert for the Hessians; with the same
    option kvq's first MoE layer (same inputs on both sides) is nibble for nibble llm-compressor's. Later
    layers differ by bf16 noise: llm-compressor runs experts as separate gate and up Linears, transformers
    (kvq's propagation) as one fused gate_up matmul."""
    src = tiny_checkpoint("glm4_moe", "bf16")
    recipe = load_recipe("w4a16-experts", 64)
    config = GptqConfig(CalibrationConfig(num_samples=10, seq_len=64), moe_calibrate_all_experts=True)
    job = prepare_gptq(src, tmp_path / "kvq", recipe, config)
    report = run_gptq(job, workers=1)
    assert not report.rtn_fallback
    recipe_path = tmp_path / "gptq.yaml"
    recipe_path.write_text(gptq_recipe_text(recipe))
    reference = Checkpoint.open(oneshot_gptq(src, recipe_path, job.samples.input_ids, tmp_path / "oneshot"))
    mine = Checkpoint.open(tmp_path / "kvq")
    same: dict[int, list[int]] = {}
    for name in (n for n in mine.tensors if n.endswith(".weight_packed")):
        a, b = unpack_int4(mine.read(name)), unpack_int4(reference.read(name))
        counts = same.setdefault(int(name.split(".")[2]), [0, 0])
        counts[0] += int((a == b).sum())
        counts[1] += a.numel()
    assert same[1][0] == same[1][1]  # layer 1: the first MoE layer
    assert sum(c[0] for c in same.values()) / sum(c[1] for c in same.values()) >= 0.95


def gptq_recipe_text(recipe) -> str:  # noqa: ANN001
    """`recipe` as a GPTQModifier recipe (llm-compressor's defaults) that llm-compressor reads."""
    group = {
        "targets": list(recipe.targets),
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64},
    }
    modifier = {"config_groups": {"group_0": group}, "ignore": list(recipe.ignore)}
    return json.dumps({"quant_stage": {"quant_modifiers": {"GPTQModifier": modifier}}})


@pytest.mark.slow
def test_mla_moe_fixture(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    """glm_moe_dsa (MLA attention, DSA indexer, routed experts), every Linear the group divides: every INT4
    module GPTQ'd or listed, the MLA latent's KV scales written, transformers loads kvq's weights (it cannot
    run a glm_moe_dsa checkpoint with a kv_cache_scheme: compressed-tensors' QuantizedKVCache has no
    `update_indexer`, DESIGN.md)."""
    src, out = tiny_checkpoint("glm_moe_dsa", "bf16"), tmp_path / "gptq"
    config = GptqConfig(CalibrationConfig(num_samples=10, seq_len=64), moe_min_tokens=60, calibrate_kv=True)
    job = prepare_gptq(src, out, load_recipe("w4a16-linear", 64), config)
    report = run_gptq(job, workers=2)
    assert report.num_gptq + len(report.rtn_fallback) == len(job.compress.plan.int4_modules)
    assert report.num_gptq and report.rtn_fallback and report.kv_scales_written
    assert all(".mlp.experts." in name for name in report.rtn_fallback)
    record = read_json(out / "kvq_manifest.json", "manifest")["kv_calibration"]
    assert record["kv_layout"]["kind"] == "mla" and set(record["layers"][0]["amax"]) == {"kv_c", "k_pe"}
    assert_holds_kvqs_weights(load(out), out)


def test_the_mtp_layer_is_round_to_nearest_and_listed(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """glm_moe_dsa with an MTP layer, `w4a16-experts`: GPTQ's streamed forward does not run the MTP layer, so
    its INT4 modules are round-to-nearest's bytes, each listed with that reason (docs/mtp.md), and the MTP
    tensors are in the index as `kvq compress` writes them."""
    src, out = tiny_checkpoint("glm_moe_dsa", "bf16", num_mtp_layers=1), tmp_path / "gptq"
    config = GptqConfig(CalibrationConfig(num_samples=10, seq_len=64), moe_min_tokens=1)
    job = prepare_gptq(src, out, load_recipe("w4a16-experts", 64), config)
    report = run_gptq(job, workers=2)
    mtp_layer = f"model.layers.{read_json(src / 'config.json', 'config')['num_hidden_layers']}."
    mtp_modules = {m for m in job.compress.plan.int4_modules if m.startswith(mtp_layer)}
    assert any(".mlp.experts." in m for m in mtp_modules)
    assert {m for m in report.rtn_fallback if m.startswith(mtp_layer)} == mtp_modules
    assert all("MTP layer: round-to-nearest" in report.rtn_fallback[m] for m in mtp_modules)
    rtn = tmp_path / "rtn"
    run(prepare(src, rtn, load_recipe("w4a16-experts", 64)), 2)
    mine, reference = Checkpoint.open(out), Checkpoint.open(rtn)
    assert read_json(out / INDEX_NAME, "index")["weight_map"].keys() == reference.tensors.keys()
    for name in reference.tensors:
        if name.startswith(mtp_layer):
            assert torch.equal(mine.read(name), reference.read(name)), name
