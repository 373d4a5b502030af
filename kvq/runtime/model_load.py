"""What `ModelRunner` loads once: this rank's model from the checkpoint (weights kept as stored: INT4
packed, FP8, BF16), the tensor-parallel group it joins, and the paged KV pool bound to its attention layers.

Rank 0 loads its shard before the ranks meet, so a bad checkpoint fails before the others start. Every
rank sizes the same pool (as many pages as all of them can hold: rank 0's block manager hands the page
ids out). Imports torch, transformers (config) and kvq.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

import torch

from kvq.checkpoint.kv_cache_spec import KvCacheSpec, kv_cache_spec
from kvq.checkpoint.model_config import TextModel, pretrained_config, read_text_model
from kvq.checkpoint.reader import Checkpoint
from kvq.errors import KvqError
from kvq.runtime.config import EngineConfig
from kvq.runtime.decode_plan import describe_decode
from kvq.runtime.distributed.group import TpGroup
from kvq.runtime.kernels import describe_cpu_path
from kvq.runtime.kv_layout import layout_for
from kvq.runtime.kv_pool import KVPool, page_bytes
from kvq.runtime.loader import WeightLoader
from kvq.runtime.models.llama import LlamaForCausalLM
from kvq.runtime.models.mtp import MultiTokenPredictor, check_mtp
from kvq.runtime.models.registry import model_class

logger = logging.getLogger("kvq")


@dataclass(frozen=True)
class LoadedModel:
    """This rank's model, its group, and what the engine reads of the checkpoint."""

    ckpt: Checkpoint
    text_model: TextModel  # the language model's config (Kimi: under text_config)
    kv_spec: KvCacheSpec  # as `kvq plan` sizes it
    model: LlamaForCausalLM
    tp: TpGroup
    max_model_len: int
    rank_read_bytes: list[int]  # per rank: stored bytes read (what `kvq plan --tp N` counts per GPU)
    rank_weight_bytes: list[int]  # per rank: bytes held resident
    mtp: MultiTokenPredictor | None = None  # the draft layer of --speculative mtp (loaded only then)


def load_model(config: EngineConfig) -> LoadedModel:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    ckpt = Checkpoint.open(config.model)
    text_model = read_text_model(ckpt.root)
    hf_config = pretrained_config(text_model)
    tp = TpGroup.of(config.tp)
    mtp_layer = check_mtp(text_model, str(ckpt.root)) if config.speculative == "mtp" else None
    with WeightLoader(ckpt, config, text_model, tp) as loader:
        model = model_class(text_model)(hf_config, loader)
        mtp = None if mtp_layer is None else MultiTokenPredictor(model, loader, mtp_layer)
        loader.finish()
    tp.connect(config.torch_device, json.dumps(asdict(config)))
    if config.torch_device.type == "cpu":
        logger.info(describe_cpu_path(model.cpu_ops, config.int4_compute))
        logger.info(describe_decode(model, config.enforce_eager))
    return LoadedModel(
        ckpt,
        text_model,
        kv_cache_spec(text_model.fields, text_model.at),
        model,
        tp,
        _max_model_len(config.max_model_len, hf_config.max_position_embeddings),
        tp.gather_ints(loader.read_bytes),
        tp.gather_ints(weight_bytes(model, mtp)),
        mtp,
    )


def weight_bytes(model: LlamaForCausalLM, mtp: MultiTokenPredictor | None = None) -> int:
    """Bytes of every weight tensor the model (and its MTP layer) keeps resident."""
    tensors = [*model.tensors(), *(mtp.tensors() if mtp is not None else [])]
    return sum(t.numel() * t.element_size() for t in tensors)


def make_kv_pool(config: EngineConfig, loaded: LoadedModel) -> KVPool:
    """Pages for the budget (no more than max_num_seqs full contexts); each attention layer gets its cache
    object over them. An MTP layer's latent pages are one more layer of the same pages (same slots)."""
    layers = loaded.model.attention_layers() + (loaded.mtp.attention_layers() if loaded.mtp else [])
    has_scales = loaded.ckpt.quantization_config.get("kv_cache_scheme") is not None
    layout = layout_for(loaded.kv_spec, config.kv_torch_dtype(has_scales), loaded.tp.size)
    max_pages = config.max_num_seqs * -(-loaded.max_model_len // config.page_size)
    is_checked = config.kv_integrity != "off"  # slot stamps only in a checked pool
    num_pages = config.kv_pool_bytes() // page_bytes(layout, len(layers), config.page_size, is_checked)
    num_pages = loaded.tp.min_int(min(num_pages, max_pages))
    model = loaded.model
    pool = KVPool(
        layout,
        len(layers),
        num_pages,
        config.page_size,
        config.torch_device,
        is_checked,
        backend=model.backend,  # the kernels the weights were prepared for
        cpu_ops=model.cpu_ops,
    )
    pool.layer_caches(
        [a.kv_scales for a in layers], require_kv_scales=config.require_kv_scales, where=str(loaded.ckpt.root)
    )
    pool.bind(layers)
    return pool


def _max_model_len(requested: int | None, max_positions: int) -> int:
    if requested is not None and requested > max_positions:
        raise KvqError(
            f"--max-model-len {requested} exceeds the model's max_position_embeddings {max_positions}; "
            f"pass at most {max_positions}"
        )
    return requested or max_positions
