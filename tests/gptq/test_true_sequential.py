"""`--true-sequential`: a layer's Linears calibrated group by group, each on the quantized groups' outputs.

The groups are the Linears fed one input tensor, in the order the forward reaches them; the first
group sees what a whole-layer pass sees (its codes are GPTQ's), a later group the inputs the quantized
groups before it give: exactly the Hessian a whole-layer pass computes on a checkpoint whose earlier
groups hold those quantized weights. GPTAQ's full-precision stream runs the original weights throughout.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvq.calibrate.calibration_config import CalibrationConfig
from kvq.commands.gptq_options import GptqOptions
from kvq.compress.manifest import read_manifest
from kvq.compress.recipe import load_recipe, resolve_recipe_path
from kvq.formats.pack_quantized import dequantize_pack_quantized
from kvq.gptq.gptq_config import GptqConfig
from kvq.gptq.gptq_job import GptqReport, prepare_gptq, run_gptq
from kvq.gptq.staging import STAGING_DIR
from tests.calibrate.test_errors import snapshot
from tests.compress.conftest import compress_argv
from tests.conftest import TinyCheckpoint
from tests.gptq.test_gptaq import Interrupted, stop

CALIBRATION = CalibrationConfig(num_samples=10, seq_len=64)
LLAMA_GROUPS = [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


def compress(src: Path, out: Path, alpha: float | None, true_sequential: bool, **kwargs) -> GptqReport:  # noqa: ANN003
    config = GptqConfig(CALIBRATION, gptaq_alpha=alpha, moe_min_tokens=0, true_sequential=true_sequential)
    return run_gptq(prepare_gptq(src, out, load_recipe("w4a16-linear", 64), config), 2, **kwargs)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def modules(out: Path) -> dict[str, dict]:
    manifest = read_manifest(out)
    assert manifest is not None
    return {n: m for rec in manifest["gptq"]["layers"].values() for n, m in rec["modules"].items()}


def with_quantized(src: Path, dst: Path, quantized: dict[str, torch.Tensor], names: list[str]) -> Path:
    """A copy of the bf16 checkpoint `src` whose `names` hold their dequantized INT4 weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        for name in names:
            if f"{name}.weight" in tensors:
                packed, scale = quantized[f"{name}.weight_packed"], quantized[f"{name}.weight_scale"]
                tensors[f"{name}.weight"] = dequantize_pack_quantized(packed, scale).bfloat16()
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_each_group_calibrates_on_the_quantized_groups_before_it(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src = tiny_checkpoint("llama", "bf16")
    plain, seq = tmp_path / "plain", tmp_path / "seq"
    compress(src, plain, None, False)
    report = compress(src, seq, None, True)
    assert report.num_gptq == 14
    manifest = read_manifest(seq)
    assert manifest is not None and manifest["job"]["method"]["options"]["true_sequential"] is True
    recorded = modules(seq)
    for g, group in enumerate(LLAMA_GROUPS):  # the forward's order, Linears sharing an input together
        for proj in group:
            part = "self_attn" if "proj" in proj and proj[0] in "qkvo" else "mlp"
            assert recorded[f"model.layers.0.{part}.{proj}"]["sequential_group"] == g
    a, b = weights(plain), weights(seq)
    first = [f"model.layers.0.self_attn.{p}_proj.weight_packed" for p in "qkv"]
    assert all(torch.equal(a[k], b[k]) for k in first)  # the first group sees a whole-layer pass's inputs
    assert not torch.equal(
        a["model.layers.0.self_attn.o_proj.weight_packed"], b[first[0].replace("q_", "o_")]
    )

    # o_proj's Hessian is the whole-layer one of a checkpoint whose q/k/v hold the quantized weights
    qkv = [k.removesuffix(".weight_packed") for k in first]
    oracle = tmp_path / "oracle"
    compress(with_quantized(src, tmp_path / "src-qkv", b, qkv), oracle, None, False)
    o_proj = "model.layers.0.self_attn.o_proj.weight_packed"
    assert torch.equal(weights(oracle)[o_proj], b[o_proj])


@pytest.mark.slow
def test_gptaq_true_sequential_resumes_byte_identical(
    tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    src = tiny_checkpoint("llama", "fp8-block")
    whole, out, plain = tmp_path / "whole", tmp_path / "out", tmp_path / "plain"
    compress(src, whole, 0.25, True)
    assert {m["method"] for m in modules(whole).values()} == {"gptaq"}
    with pytest.raises(Interrupted):
        compress(src, out, 0.25, True, on_layer_done=stop)
    report = compress(src, out, 0.25, True)
    assert (report.layers_resumed, report.layers_done) == (1, [1])
    assert not (out / STAGING_DIR).exists() and snapshot(out) == snapshot(whole)
    # layer 0: the first group sees X = X_fp (GPTQ's codes); o_proj's X comes from the quantized q/k/v
    # while its X_fp comes from the original ones, so GPTAQ moves its codes
    compress(src, plain, 0.25, False)
    a, b = weights(plain), weights(whole)
    assert torch.equal(
        a["model.layers.0.self_attn.q_proj.weight_packed"], b["model.layers.0.self_attn.q_proj.weight_packed"]
    )
    assert not torch.equal(
        a["model.layers.0.self_attn.o_proj.weight_packed"], b["model.layers.0.self_attn.o_proj.weight_packed"]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "recipe"),
    [("glm4_moe", "w4a16-linear"), ("glm_moe_dsa", "w4a16-linear"), ("glm4_moe", "routed-experts")],
)
def test_moe_and_mla_layers_run_true_sequential(
    arch: str, recipe: str, tiny_checkpoint: TinyCheckpoint, tmp_path: Path
) -> None:
    """MoE (routed experts recorded in the last group's pass; only experts targeted: one pass) and MLA
    (q_a/kv_a share the layer's input; the latent's q_b / kv_b after them) layers: every target
    calibrated, dense ones in at least three groups."""
    src, out = tiny_checkpoint(arch, "bf16"), tmp_path / "out"
    if recipe == "routed-experts":  # w4a16-experts without its shared-experts target
        text = resolve_recipe_path("w4a16-experts").read_text()
        recipe = str(tmp_path / "routed-experts.yaml")
        Path(recipe).write_text("\n".join(ln for ln in text.splitlines() if "shared_experts" not in ln))
    config = GptqConfig(CALIBRATION, moe_min_tokens=0, true_sequential=True, gptaq_alpha=0.25)
    job = prepare_gptq(src, out, load_recipe(recipe, 64), config)
    report = run_gptq(job, workers=2)
    assert report.num_gptq == len(job.compress.plan.int4_modules) and not report.rtn_fallback
    recorded = modules(out)
    experts = {n: m for n, m in recorded.items() if ".mlp.experts." in n}
    assert experts and {m["method"] for m in experts.values()} == {"gptq"}
    routed: dict[tuple[str, str], int] = {}  # (layer, expert) -> its routed calibration tokens
    for name, m in experts.items():
        layer, _, rest = name.partition(".mlp.experts.")
        routed[(layer, rest.split(".")[0])] = m["routed_tokens"]
    top_k = json.loads((src / "config.json").read_text())["num_experts_per_tok"]
    for layer in {layer for layer, _ in routed}:  # every token reached its top-k experts in the last pass
        total = sum(n for (lay, _), n in routed.items() if lay == layer)
        assert total == CALIBRATION.num_samples * CALIBRATION.seq_len * top_k
    dense = {n: m for n, m in recorded.items() if ".mlp.experts." not in n}
    assert {m["method"] for m in dense.values()} == ({"gptaq"} if recipe == "w4a16-linear" else set())
    if dense:
        groups = {m["sequential_group"] for n, m in dense.items() if ".layers.0." in n}
        assert len(groups) >= 3 and groups == set(range(len(groups)))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"


def test_true_sequential_is_refused_for_rtn(tiny_checkpoint: TinyCheckpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "bf16")
    argv = compress_argv(src, tmp_path / "out", "w4a16-linear", "--true-sequential")
    done = subprocess.run(argv, capture_output=True, text=True)
    assert (
        done.returncode != 0 and "--true-sequential only apply to --method gptq" in done.stderr + done.stdout
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_default_is_on_for_gptaq_and_off_for_gptq() -> None:
    assert GptqOptions(method="gptaq").config().true_sequential is True
    assert GptqOptions(method="gptaq", true_sequential=False).config().true_sequential is False
    assert GptqOptions(method="gptq").config().true_sequential is False
    assert GptqOptions(method="gptq", true_sequential=True).config().true_sequential is True
    assert GptqOptions().config().record() == GptqConfig().record()  # GPTQ jobs keep their identity
