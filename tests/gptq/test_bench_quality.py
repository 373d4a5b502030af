"""`kvq bench gptq`'s scoring step on the tiny llama: it runs a real `kvq eval` (text only, BF16 KV) and reads
the perplexity from the JSON `kvq eval` writes, so a change of that JSON's layout fails here, not an hour
into the bench."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvq.bench.compress_gptq import calibration_ids, oneshot_gptq
from kvq.bench.gptq_quality import GptqQualityConfig, build_outputs, perplexity
from kvq.checkpoint.reader import Checkpoint
from kvq.gptq.observer import mse_weight_scale


def test_perplexity_is_the_one_kvq_eval_reports(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama", "bf16")
    out = tmp_path / "eval.json"
    value = perplexity(GptqQualityConfig(eval_windows=2, eval_seq_len=32, threads=1), model, None, out)
    report = json.loads(out.read_text())
    assert report["settings"]["tasks"] == ["text"] and report["settings"]["num_windows"] == 2
    text = report["runs"][0]["items"]["text"]
    # perplexity = exp(total NLL / predicted tokens) over the scored windows
    assert math.isclose(value, math.exp(sum(text["nll"]) / (text["num_predicted"] * 2)), rel_tol=1e-6)
    assert value > 1


def test_without_llm_compressor_builds_rtn_and_kvq_gptq_only(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "bf16")
    config = GptqQualityConfig(num_samples=10, seq_len=64, threads=1, llm_compressor=False)
    outputs = build_outputs(config, src, tmp_path)
    assert set(outputs) == {"rtn", "kvq-gptq"} and not (tmp_path / "llm-compressor-gptq").exists()
    walls = json.loads((tmp_path / "walls.json").read_text())["walls"]
    assert set(walls) == {"rtn", "kvq-gptq"} and all(w > 0 for w in walls.values())
    manifest = json.loads((tmp_path / "kvq-gptq" / "kvq_manifest.json").read_text())
    assert manifest["job"]["method"]["calibration"]["num_samples"] == 10
    assert build_outputs(config, src, tmp_path) == outputs  # done before: not built again


def test_the_gptq_recipe_and_gptaq_are_options(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama", "bf16")
    config = GptqQualityConfig(
        num_samples=10,
        seq_len=64,
        threads=1,
        llm_compressor=False,
        recipe="w4a16-linear-gptq-mse",
        gptaq=True,
    )
    assert set(build_outputs(config, src, tmp_path)) == {"rtn", "kvq-gptq", "kvq-gptaq"}
    for name, method in (("kvq-gptq", "gptq"), ("kvq-gptaq", "gptaq")):
        manifest = json.loads((tmp_path / name / "kvq_manifest.json").read_text())
        assert manifest["job"]["method"]["name"] == method
        assert manifest["job"]["method"]["gptq"]["observer"] == "mse"
        assert manifest["job"]["recipe"]["name"] == "w4a16-linear-gptq-mse"


@pytest.mark.slow
def test_oneshot_runs_the_recipes_observer(tiny_checkpoint, tmp_path: Path) -> None:
    """The bench's llm-compressor side takes `observer: mse` from the recipe: its scales are the MSE ones."""
    src = tiny_checkpoint("llama", "bf16")
    ids = tmp_path / "ids.pt"
    calibration_ids(src, 4, 64, ids)
    oneshot_gptq(str(src), str(tmp_path / "out"), "w4a16-linear-gptq-mse", str(ids), 64)
    mine, source = Checkpoint.open(tmp_path / "out"), Checkpoint.open(src)
    name = "model.layers.0.mlp.down_proj"
    weight = source.read(f"{name}.weight")
    assert torch.equal(mine.read(f"{name}.weight_scale"), mse_weight_scale(weight, 64))
