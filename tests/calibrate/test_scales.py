"""amax -> k_scale / v_scale: amax/448 in bf16, per tensor or per KV head; MLA covers kv_c and k_pe."""

from __future__ import annotations

import torch

from kvq.calibrate.observed_kv import ObservedKV, observed_kv
from kvq.calibrate.scales import amax_to_scale, layer_scales

GQA = ObservedKV("gqa", num_layers=2, num_kv_heads=3, head_dim=64, max_positions=128)
MLA = ObservedKV(
    "mla",
    num_layers=2,
    num_kv_heads=1,
    head_dim=192,
    max_positions=128,
    kv_lora_rank=128,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
)


def test_amax_to_scale() -> None:
    scale = amax_to_scale(torch.tensor([448.0, 1.0, 0.0, 3.3]))
    assert scale.dtype == torch.bfloat16
    assert scale.tolist() == [
        1.0,
        torch.tensor(1 / 448).bfloat16().item(),
        torch.finfo(torch.bfloat16).eps,
        torch.tensor(3.3 / 448).bfloat16().item(),
    ]


def test_gqa_tensor_and_attn_head() -> None:
    observed = {"k": torch.tensor([1.0, 4.48, 2.0]), "v": torch.tensor([0.5, 0.25, 44.8])}
    tensor = layer_scales(GQA, "tensor", 1, observed)
    assert tensor["model.layers.1.self_attn.k_scale"].tolist() == [torch.tensor(0.01).bfloat16().item()]
    assert tensor["model.layers.1.self_attn.v_scale"].tolist() == [torch.tensor(0.1).bfloat16().item()]
    head = layer_scales(GQA, "attn_head", 1, observed)
    assert head["model.layers.1.self_attn.k_scale"].shape == (3, 1, 1)
    assert torch.equal(head["model.layers.1.self_attn.v_scale"].flatten(), amax_to_scale(observed["v"]))


def test_mla_scale_covers_the_whole_latent_entry() -> None:
    scales = layer_scales(MLA, "tensor", 0, {"kv_c": torch.tensor([2.0]), "k_pe": torch.tensor([8.96])})
    assert scales["model.layers.0.self_attn.k_scale"].tolist() == [torch.tensor(0.02).bfloat16().item()]
    assert torch.equal(scales["model.layers.0.self_attn.k_scale"], scales["model.layers.0.self_attn.v_scale"])


def test_layout_from_config() -> None:
    gqa = observed_kv(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "max_position_embeddings": 2048,
        },
        "c: ",
    )
    assert (gqa.kind, gqa.num_kv_heads, gqa.head_dim, gqa.observed) == ("gqa", 2, 64, ("k", "v"))
    mla = observed_kv(
        {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "max_position_embeddings": 2048,
        },
        "c: ",
    )
    assert (mla.kind, mla.num_kv_heads, mla.head_dim, mla.observed) == ("mla", 1, 576, ("kv_c", "k_pe"))
