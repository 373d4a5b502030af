"""A corpus of checkpoints that contradict their config.json (and a few that do not split at some --tp),
each made from a tiny fixture in a temporary directory: what plan, compress and check must refuse by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import strategies as st
from safetensors.torch import load_file

from kvq.checkpoint.write import save_safetensors_atomic, write_json_atomic
from kvq.fixtures.tiny_models import tiny_config
from tests.compress.synthetic import random_checkpoint

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class BadCase:
    """How to spoil a tiny llama checkpoint, the validation rule that refuses it and what it names."""

    edit: Callable[[Tensors, dict], None]
    rule: str
    names: str


def _int8_linears(tensors: Tensors, config: dict) -> None:
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and (".self_attn." in name or ".mlp." in name):
            tensors[name] = (tensor.float() * 4000).round().clamp(-127, 127).to(torch.int8)  # [out, in]


def _wrong_shape(tensors: Tensors, config: dict) -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-64].clone()  # [I - 64, H]


def _more_layers_in_config(tensors: Tensors, config: dict) -> None:
    config["num_hidden_layers"] += 1


def _extra_layers(tensors: Tensors, config: dict) -> None:
    config["num_hidden_layers"] -= 1


def _missing_tensor(tensors: Tensors, config: dict) -> None:
    del tensors["model.layers.1.post_attention_layernorm.weight"]


def _unknown_model_type(tensors: Tensors, config: dict) -> None:
    config["model_type"] = "llama_next"


def _zero_heads(tensors: Tensors, config: dict) -> None:
    config["num_attention_heads"] = 0


CASES = {
    "int8-linears": BadCase(_int8_linears, "dtype", "model.layers.0.self_attn.q_proj.weight is I8"),
    "wrong-shape": BadCase(_wrong_shape, "shape", "model.layers.0.mlp.up_proj.weight has shape [512, 256]"),
    "more-layers-in-config": BadCase(_more_layers_in_config, "layers", "model.layers.2 is absent"),
    "extra-layers": BadCase(_extra_layers, "layers", "model.layers.1 is stored"),
    "missing-tensor": BadCase(_missing_tensor, "missing", "model.layers.1.post_attention_layernorm.weight"),
    "unknown-model-type": BadCase(_unknown_model_type, "model-type", "'llama_next'"),
    "zero-heads": BadCase(_zero_heads, "config", "num_attention_heads is 0"),
}


# Values a hand-edited or hostile config.json holds where a size belongs.
FUZZ_VALUES = st.one_of(
    st.integers(min_value=-3, max_value=10**12),
    st.sampled_from([None, True, "4", 2.5, [], {}]),
)
FUZZ_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "model_type",
    "tie_word_embeddings",
    "num_nextn_predict_layers",
    "rope_scaling",
    "quantization_config",
    "text_config",
    "n_routed_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "index_topk",
)


def spoiled(src: Path, dst: Path, case: str) -> Path:
    """`src` (a checkpoint directory) rewritten into `dst` as one shard, spoiled as `CASES[case]` says."""
    tensors: Tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    config = json.loads((src / "config.json").read_text())
    CASES[case].edit(tensors, config)
    dst.mkdir(parents=True)
    save_safetensors_atomic(tensors, dst / "model.safetensors")
    write_json_atomic(config, dst / "config.json")
    for side in src.iterdir():
        if side.suffix != ".safetensors" and side.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(side, dst / side.name)
    return dst


def heads_checkpoint(dst: Path, num_heads: int, num_kv_heads: int, vocab_size: int = 2004) -> Path:
    """A valid tiny llama with `num_heads` attention and `num_kv_heads` KV heads (head_dim 64): what each
    engine's --tp rules decide on."""
    config = tiny_config("llama", vocab_size=vocab_size)
    config.num_attention_heads, config.num_key_value_heads = num_heads, num_kv_heads
    config.hidden_size = num_heads * config.head_dim  # transformers wants hidden divisible by heads
    return random_checkpoint(dst, config, "bf16")
