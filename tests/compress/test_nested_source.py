"""`kvq compress` of a model nested in a multimodal config (Kimi K2.5 / K2.6: kimi_k25 + text_config, tensors
under `language_model.` beside a vision tower), and of the Kimi-shaped deepseek_v3 fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.model_config import read_text_model
from kvq.checkpoint.reader import Checkpoint, block_size
from kvq.checkpoint.write import save_safetensors_atomic, write_json_atomic
from kvq.compress.recipe import load_recipe
from kvq.compress.size_plan import size_plan
from kvq.compress.tensor_plan import build_plan
from kvq.errors import KvqError
from tests.compress.conftest import compress


def bf16_kimi(kimi_int4: Path, out: Path) -> Path:
    """Kimi's layout, every weight dequantized to BF16, no quantization_config: a source to compress."""
    out.mkdir()
    weights = read_dense(Checkpoint.open(kimi_int4), "", torch.float32)
    save_safetensors_atomic(
        {n: t if n.endswith("e_score_correction_bias") else t.bfloat16() for n, t in weights.items()},
        out / "model.safetensors",
    )
    config = json.loads((kimi_int4 / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    write_json_atomic(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(kimi_int4 / name, out / name)
    return out


def test_bf16_kimi_source_compresses_its_language_model_only(tiny_checkpoint, tmp_path):
    src = bf16_kimi(tiny_checkpoint("deepseek_v3", "kimi-int4"), tmp_path / "src")
    out = compress(src, tmp_path / "out", "w4a16-linear")
    ckpt = Checkpoint.open(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # kept where Kimi keeps it
    qc = config["text_config"]["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert read_text_model(out).quantization_config == qc
    packed = {n.removesuffix(".weight_packed") for n in ckpt.tensors if n.endswith(".weight_packed")}
    assert packed and all(n.startswith("language_model.model.layers.") for n in packed)
    assert "language_model.model.layers.1.self_attn.kv_b_proj" in packed  # every LM Linear (in 128)
    # The vision tower is copied as is and named in ignore, as are the recipe's lm_head and the routers.
    assert ckpt.tensors["vision_tower.encoder.blocks.0.wqkv.weight"].dtype == "BF16"
    assert {"vision_tower.encoder.blocks.0.wqkv", "mm_projector.proj.0"} <= set(qc["ignore"])
    assert ckpt.tensors["language_model.lm_head.weight"].dtype == "BF16"
    assert "language_model.model.layers.1.mlp.gate.weight" in ckpt.tensors
    # compressed-tensors' own reader finds the nested config, decompresses every INT4 Linear and finds no
    # quantization parameter outside its ignore list.
    dense = CompressedTensorsDequantizer(out, dtype=torch.bfloat16).validate(ckpt.read_many(ckpt.tensors))
    ours = read_dense(ckpt, "", torch.float32)
    for module in packed:
        assert torch.equal(dense[f"{module}.weight"], ours[f"{module}.weight"].bfloat16()), module


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_deepseek_v3_fixture_compresses_to_the_planned_bytes(tiny_checkpoint, tmp_path, fmt):
    src = tiny_checkpoint("deepseek_v3", fmt)
    out = compress(src, tmp_path / "out")
    ckpt = Checkpoint.open(src)
    predicted = size_plan(build_plan(ckpt.tensors, load_recipe("w4a16-experts"), block_size(ckpt)), 0)
    assert predicted.output_file_bytes == sum(p.stat().st_size for p in out.glob("*.safetensors"))
    stored = Checkpoint.open(out)
    assert stored.format == ("mixed" if fmt == "fp8-block" else "pack-quantized")
    # q_lora_rank 160: q_b_proj's input is one full and one partial FP8 block, which no engine's FP8 GEMM
    # runs (dynamic per-group activation quantization): written as BF16, no scale.
    if fmt == "fp8-block":
        assert stored.tensors["model.layers.1.self_attn.q_b_proj.weight"].dtype == "BF16"
        assert "model.layers.1.self_attn.q_b_proj.weight_scale" not in stored.tensors


def test_an_already_compressed_kimi_checkpoint_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(KvqError, match="already compressed-tensors output"):
        compress(tiny_checkpoint("deepseek_v3", "kimi-int4"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
