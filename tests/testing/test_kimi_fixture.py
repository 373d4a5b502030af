"""The Kimi-native INT4 fixture: laid out as Kimi K2.6 ships, decompressed by compressed-tensors to what kvq
reads, holding the deepseek_v3 BF16 fixture's model, and its DeepSeek-V3 oracle runs in transformers."""

from __future__ import annotations

import json
import re

import torch
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.model_config import read_text_model
from kvq.checkpoint.reader import Checkpoint
from kvq.testing.kimi_fixture import GROUP_SIZE, kimi_oracle_model

DATA_CONFIG = "tests/compress/data/kimi-k2.6-config.json"
ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight_(packed|scale|shape)$")


def test_layout_is_kimi_k26s(tiny_checkpoint):
    root = tiny_checkpoint("deepseek_v3", "kimi-int4")
    ckpt = Checkpoint.open(root)
    config = json.loads((root / "config.json").read_text())
    published = json.loads(open(DATA_CONFIG).read())
    assert (config["model_type"], config["text_config"]["model_type"]) == ("kimi_k25", "kimi_k2")
    assert "quantization_config" not in config  # nested, as in the release
    assert config["text_config"]["quantization_config"] == published["text_config"]["quantization_config"]
    assert ckpt.format == "pack-quantized" and len(ckpt.shards) >= 3
    packed = [n for n in ckpt.tensors if n.endswith("weight_packed")]
    assert packed and all(ROUTED.search(n) for n in packed)
    assert len(packed) == 2 * 8 * 3  # every routed expert of both MoE layers, nothing else
    for name in packed:
        module = name.removesuffix(".weight_packed")
        rows, words = ckpt.tensors[name].shape
        assert ckpt.tensors[name].dtype == "I32"
        assert ckpt.tensors[f"{module}.weight_scale"].shape == (rows, words * 8 // GROUP_SIZE)
        assert ckpt.tensors[f"{module}.weight_scale"].dtype == "BF16"
        assert ckpt.tensors[f"{module}.weight_shape"].dtype == "I32"  # as the release stores it
    others = {n: i for n, i in ckpt.tensors.items() if not ROUTED.search(n)}
    assert all(
        n.startswith(("language_model.model.", "language_model.lm_head.", "vision_tower.", "mm_projector."))
        for n in others
    )
    assert {i.dtype for n, i in others.items() if not n.endswith("e_score_correction_bias")} == {"BF16"}
    for kind in ("self_attn.q_b_proj", "mlp.shared_experts.down_proj", "mlp.gate", "self_attn.kv_b_proj"):
        assert f"language_model.model.layers.1.{kind}.weight" in others, kind
    assert "language_model.model.layers.0.mlp.down_proj.weight" in others  # the dense first layer
    assert read_text_model(root).weight_prefix == "language_model."


def test_compressed_tensors_decompresses_it_to_the_bf16_fixtures_model(tiny_checkpoint):
    root = tiny_checkpoint("deepseek_v3", "kimi-int4")
    ckpt = Checkpoint.open(root)
    stored = ckpt.read_many(ckpt.tensors)
    oracle = CompressedTensorsDequantizer(root, dtype=torch.bfloat16).validate(dict(stored))
    ours = read_dense(ckpt, "", torch.float32)
    assert oracle.keys() == ours.keys()
    bf16 = Checkpoint.open(tiny_checkpoint("deepseek_v3", "bf16"))
    reference = bf16.read_many(bf16.tensors)
    for name, tensor in ours.items():
        # compressed-tensors multiplies in the scale's dtype (bf16): one rounding of kvq's exact fp32 product
        assert torch.equal(tensor.to(oracle[name].dtype), oracle[name]), name
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue
        source = reference[name.removeprefix("language_model.")].float()
        if ".mlp.experts." not in name:
            assert torch.equal(tensor, source), name  # kept BF16, same values as the BF16 fixture
            continue
        scale = stored[f"{name.removesuffix('.weight')}.weight_scale"].float()
        step = scale.repeat_interleave(GROUP_SIZE, dim=1)
        # round to nearest; at the clamp (+7.5 steps -> 7) the bf16-rounded scale adds up to 7.5 x 2^-8
        assert ((tensor - source).abs() <= step * (0.5 + 7.5 * 2**-8)).all(), name
        assert not torch.equal(tensor, source), name


def test_oracle_is_deepseek_v3_on_the_dequantized_weights(tiny_checkpoint):
    root = tiny_checkpoint("deepseek_v3", "kimi-int4")
    oracle = kimi_oracle_model(root)
    assert isinstance(oracle, DeepseekV3ForCausalLM) and oracle.dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("deepseek_v3", "bf16"), dtype=torch.float32
    )
    ours, theirs = oracle.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    differ = {n for n in ours if not torch.equal(ours[n], theirs[n])}
    assert differ == {
        f"model.layers.{i}.mlp.experts.{p}" for i in (1, 2) for p in ("gate_up_proj", "down_proj")
    }
    ids = torch.tensor([[1, 17, 400, 33, 1024, 7, 250, 99, 3]])
    with torch.no_grad():
        logits, ref_logits = oracle(ids).logits, reference(ids).logits  # [1, S, V]
    assert torch.isfinite(logits).all() and logits.argmax(-1).unique().numel() > 1
    # INT4 group-32 experts move the logits a little, not the model (random tiny logits are nearly flat,
    # so top-1 agreement says less than the correlation does)
    assert 0 < (logits - ref_logits).abs().max() < 0.2 * ref_logits.abs().max()
    assert torch.corrcoef(torch.stack([logits.flatten(), ref_logits.flatten()]))[0, 1] > 0.99
    out = oracle.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
