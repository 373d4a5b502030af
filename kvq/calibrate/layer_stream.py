"""Run calibration samples through a model one decoder layer at a time, never holding the whole model.

The model is built on the meta device (no memory) from config.json's language model
(`kvq.checkpoint.model_config`) so each transformers decoder layer class is used as is; the checkpoint is
read through `Checkpoint.under(weight_prefix)`, in transformers' tensor names. Embeddings turn every
sample into hidden states; then for each layer: load only that layer's weights from the shards
(dequantizing FP8 / INT4), run every sample through it with the model's rotary embedding and causal mask
and a `KvRecorder` as its cache, free it, and carry the hidden states on. Peak memory: one layer plus
the hidden states of all samples.
Imports torch, transformers and kvq (checkpoint, calibrate).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_causal_mask

from kvq.calibrate.layer_weights import load_layer_weights
from kvq.calibrate.memory import limit_primitive_cache, release_freed
from kvq.calibrate.observers import KvRecorder
from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError

# Mask options a model's own forward passes to `create_causal_mask`; DSA's indexer needs the 4-D mask.
_MASK_OPTIONS: dict[str, dict] = {
    "glm_moe_dsa": {"allow_is_causal_skip": False},
    "deepseek_v32": {"allow_is_causal_skip": False},
}

LayerDone = Callable[[int], None]


@dataclass
class StreamState:
    """What flows between layers: one hidden-state tensor per sample (and DSA's shared top-k picks)."""

    hidden: list[torch.Tensor]  # each [1, S, hidden] in the compute dtype
    topk: list[torch.Tensor | None]  # per sample, the previous full-indexer layer's top-k (glm_moe_dsa)


def meta_model(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The whole model on the meta device: module structure and dtypes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def embed(model: PreTrainedModel, ckpt: Checkpoint, input_ids: torch.Tensor) -> StreamState:
    """Hidden states of every sample after the embedding (the embedding table is freed after)."""
    embedding = model.get_input_embeddings()
    name = "model.embed_tokens."
    weight: torch.Tensor = embedding.weight  # type: ignore[assignment]
    weights = read_dense(ckpt, name, weight.dtype)  # the table can be GBs: no fp32 copy
    if f"{name}weight" not in weights:
        raise KvqError(f"{ckpt.root}: no {name}weight tensor; kvq calibrate needs the input embeddings")
    embedding.load_state_dict({k.removeprefix(name): v for k, v in weights.items()}, assign=True)
    del weights
    with torch.no_grad():
        hidden = [embedding(row.unsqueeze(0)) for row in input_ids]  # each [1, S, hidden]
    embedding.to_empty(device="meta")
    return StreamState(hidden, [None] * len(hidden))


def run_layers(
    model: PreTrainedModel,
    ckpt: Checkpoint,
    layer_names: list[list[str]],
    state: StreamState,
    recorder: KvRecorder,
    on_layer_done: LayerDone | None = None,
) -> None:
    """Stream every decoder layer over all samples, recording K/V (or the MLA latent) into `recorder`."""
    limit_primitive_cache()
    inputs = layer_inputs(model, ckpt, state.hidden[0])
    for i, names in enumerate(layer_names):
        layer = model.model.layers[i]
        load_layer_weights(layer, ckpt, i, names)
        run_layer(layer.eval(), i, state, recorder, inputs)
        layer.to_empty(device="meta")
        release_freed()
        if on_layer_done is not None:
            on_layer_done(i)


def layer_inputs(model: PreTrainedModel, ckpt: Checkpoint, hidden: torch.Tensor) -> dict:
    """What the model's own forward hands every decoder layer besides the hidden states: positions,
    rotary cos/sin and the causal mask (one set serves every sample: all have the same length)."""
    rotary_emb = getattr(model.model, "rotary_emb", None)
    if rotary_emb is None:
        raise KvqError(
            f"{ckpt.root}: {type(model).__name__} has no model-level rotary embedding; kvq calibrate "
            "supports decoder-only RoPE models (llama, glm4_moe, glm_moe_dsa, deepseek_v3, ...)"
        )
    config = model.config
    position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)  # [1, S]
    with torch.no_grad():
        position_embeddings = type(rotary_emb)(config=config)(hidden, position_ids)
        mask = create_causal_mask(
            config=config,
            inputs_embeds=hidden,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
            **_MASK_OPTIONS.get(config.model_type, {}),
        )
    return {"attention_mask": mask, "position_ids": position_ids, "position_embeddings": position_embeddings}


def run_layer(
    layer: nn.Module, layer_idx: int, state: StreamState, recorder: KvRecorder, inputs: dict
) -> None:
    """Every sample through one loaded decoder layer, its cache being `recorder`; hidden states replaced."""
    takes_topk = "prev_topk_indices" in inspect.signature(layer.forward).parameters
    attention = layer.get_submodule("self_attn")
    with torch.no_grad(), recorder.latent_hook(attention, layer_idx):
        for s, hidden in enumerate(state.hidden):
            extra = {"prev_topk_indices": state.topk[s]} if takes_topk else {}
            out = layer(hidden, past_key_values=recorder, use_cache=True, **inputs, **extra)
            if isinstance(out, tuple):  # glm_moe_dsa: (hidden, top-k indices for the next shared layer)
                out, state.topk[s] = out[0], out[1]
            state.hidden[s] = out
