"""Run the calibration samples through the MTP / NextN layers as vLLM and SGLang run them to draft, so
their own KV caches get scales measured on what they will store.

A transformers forward never reaches an MTP layer, so its inputs are computed as the engines compute
them (vLLM deepseek_mtp.py `DeepSeekMultiTokenPredictorLayer.forward`, SGLang deepseek_nextn.py
`DeepseekModelNextN.forward`): at position t, `eh_proj(cat(enorm(embed(x[t + 1])), hnorm(h[t])))`, where
`h` is the main model's output after its final norm (what the engines hand the drafter); then the MTP
decoder layer, a copy of the main layers' class, runs with the `KvRecorder` as its cache. A second MTP
layer takes the first one's output and the token after. Imports torch, transformers and kvq.
"""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel

from kvq.calibrate.layer_stream import StreamState, layer_inputs, run_layer
from kvq.calibrate.layer_weights import load_layer_weights
from kvq.calibrate.observers import KvRecorder
from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.mtp_layers import MTP_OWN_MODULES
from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError

# Per-layer lists in a config, extended for the MTP layer: a full MoE layer with its own DSA indexer.
_MTP_LAYER_TYPES = {"mlp_layer_types": "sparse", "indexer_types": "full", "layer_types": None}
_NOT_DECODER = (*MTP_OWN_MODULES, "embed_tokens", "shared_head.head")


def run_mtp_layers(
    model: PreTrainedModel,
    ckpt: Checkpoint,
    state: StreamState,
    input_ids: torch.Tensor,
    indexes: range,
    recorder: KvRecorder,
) -> None:
    """Record the KV cache of each MTP layer in `indexes`; `state` holds the last decoder layer's
    outputs for `input_ids` `[N, S]` (consumed)."""
    config = model.config
    dtype = state.hidden[0].dtype
    final_norm = _weight(ckpt, "model.norm.", dtype)
    hidden = [_rms_norm(h, final_norm, config.rms_norm_eps) for h in state.hidden]  # each [1, S, H]
    for depth, index in enumerate(indexes):
        own = read_dense(ckpt, f"model.layers.{index}.", dtype)
        embeddings = own.get(f"model.layers.{index}.embed_tokens.weight")
        if embeddings is None:  # GLM-5 shares the main embeddings
            embeddings = _weight(ckpt, "model.embed_tokens.", dtype)
        seq = input_ids.shape[1] - depth - 1  # the positions that have a next token
        if seq < 1:
            raise KvqError(f"--seq-len {input_ids.shape[1]} leaves no position for MTP layer {index}")
        mtp_in = []
        for h, ids in zip(hidden, input_ids, strict=True):
            e = _rms_norm(
                embeddings[ids[depth + 1 :]].unsqueeze(0), own[_name(index, "enorm")], config.rms_norm_eps
            )
            h = _rms_norm(h[:, :seq], own[_name(index, "hnorm")], config.rms_norm_eps)
            mtp_in.append(torch.cat([e, h], dim=-1) @ own[_name(index, "eh_proj")].T)  # [1, seq, H]
        del embeddings, own
        layer = mtp_decoder_layer(model, index)
        names = [n for n in ckpt.tensors if n.startswith(f"model.layers.{index}.") and _is_decoder(n, index)]
        load_layer_weights(layer, ckpt, index, sorted(names))
        mtp_state = StreamState(mtp_in, [None] * len(mtp_in))
        run_layer(layer.eval(), index, mtp_state, recorder, layer_inputs(model, ckpt, mtp_in[0]))
        layer.to_empty(device="meta")
        hidden = mtp_state.hidden  # the next MTP layer drafts from this one's output


def mtp_decoder_layer(model: PreTrainedModel, index: int) -> torch.nn.Module:
    """The decoder layer of MTP layer `index`, on the meta device: the main layers' class, built from a
    config whose per-layer lists are extended to `index`."""
    config = copy.deepcopy(model.config)
    for field, value in _MTP_LAYER_TYPES.items():
        types = getattr(config, field, None)
        if isinstance(types, list) and types:
            setattr(config, field, types + [value or types[-1]] * (index + 1 - len(types)))
    with torch.device("meta"):
        return type(model.model.layers[-1])(config, index)


def _is_decoder(name: str, index: int) -> bool:
    local = name.removeprefix(f"model.layers.{index}.")
    return not any(local.startswith(f"{m}.") for m in _NOT_DECODER)


def _name(index: int, module: str) -> str:
    return f"model.layers.{index}.{module}.weight"


def _weight(ckpt: Checkpoint, prefix: str, dtype: torch.dtype) -> torch.Tensor:
    weights = read_dense(ckpt, prefix, dtype)
    if f"{prefix}weight" not in weights:
        raise KvqError(f"{ckpt.root}: no {prefix}weight tensor; the MTP layers' inputs need it")
    return weights[f"{prefix}weight"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (fp32 statistics, the weight applied in the input dtype)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
