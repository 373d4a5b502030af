"""Test input: a checkpoint copy with per-tensor FP8 KV scales (amax / 448 of what entered the cache),
stand-in for `kvq calibrate`. The cache is read back from a float32 reference engine's pages, so GQA's K is
post-RoPE and MLA's latent row is `kv_c ++ k_pe` (one scale for the row, `v_scale` equal, as kvq calibrate
writes it), exactly as the runtime caches them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.kernels.paged.latent_cache import PagedLatentCache
from kvq.runtime.sampling import SamplingParams

FP8_E4M3_MAX = 448.0


def cached_amax(cache, pages: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax for k_scale, amax for v_scale) of one layer's first `num_tokens` slots on `pages`."""
    if isinstance(cache, PagedLatentCache):
        rows, _ = cache.read(pages, num_tokens)
        return rows.abs().max(), rows.abs().max()
    k, v = (c[pages].flatten(0, 1)[:num_tokens].abs().max() for c in (cache.k_cache, cache.v_cache))
    return k, v


def measure_kv_scales(path: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """`{prefix}model.layers.{i}.self_attn.{k,v}_scale` bf16 `[1]` from prefilling `prompts` in fp32."""
    config = EngineConfig(
        model=str(path), dtype="float32", kv_cache_dtype="auto", kv_memory="64MiB", device="cpu"
    )
    engine = Engine(config)
    amax = [[torch.zeros(()), torch.zeros(())] for _ in engine.kv_pool.caches]
    for prompt in prompts:
        seq = engine.make_sequence(prompt, SamplingParams(max_tokens=1))
        engine.block_manager.allocate(seq)
        engine.runner.run([seq], is_prefill=True)
        pages = torch.tensor(seq.block_table)
        for i, cache in enumerate(engine.kv_pool.caches):
            found = cached_amax(cache, pages, len(prompt))
            amax[i] = [torch.maximum(a, b) for a, b in zip(amax[i], found, strict=True)]
        engine.block_manager.deallocate(seq)
    prefix = engine.text_model.weight_prefix
    scales = {}
    for i, pair in enumerate(amax):
        for name, value in zip(("k_scale", "v_scale"), pair, strict=True):
            scales[f"{prefix}model.layers.{i}.self_attn.{name}"] = (
                (value / FP8_E4M3_MAX).reshape(1).to(torch.bfloat16)
            )
    return scales


def with_kv_scales(source: Path, out: Path, scales: dict[str, torch.Tensor]) -> Path:
    """Copy `source` to `out` adding the scales in their own shard and `kv_cache_scheme` (per tensor) to the
    quantization_config (Kimi: the one inside `text_config`)."""
    shutil.copytree(source, out)
    save_file(scales, str(out / "kv_scales.safetensors"))
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: "kv_scales.safetensors" for name in scales})
        index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((out / "config.json").read_text())
    holder = config["text_config"] if "quantization_config" in config.get("text_config", {}) else config
    quantization_config = holder.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
    quantization_config["kv_cache_scheme"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
