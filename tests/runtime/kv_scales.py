"""Test input: a checkpoint copy with per-tensor FP8 KV scales (amax / 448 of the K and V that entered
the cache), stand-in for `kvq calibrate`. K/V are read back from a float32 reference engine's pages, so
K is post-RoPE exactly as the runtime caches it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvq.runtime.config import EngineConfig
from kvq.runtime.engine import Engine
from kvq.runtime.sampling import SamplingParams

FP8_E4M3_MAX = 448.0


def measure_kv_scales(path: Path, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """`model.layers.{i}.self_attn.{k,v}_scale` bf16 `[1]` from prefilling `prompts` in fp32."""
    engine = Engine(EngineConfig(model=str(path), dtype="float32", kv_cache_dtype="auto", kv_memory="64MiB"))
    k_amax = [torch.zeros(()) for _ in engine.kv_pool.caches]
    v_amax = [torch.zeros(()) for _ in engine.kv_pool.caches]
    for prompt in prompts:
        seq = engine.make_sequence(prompt, SamplingParams(max_tokens=1))
        engine.block_manager.allocate(seq)
        engine.runner.run([seq], is_prefill=True)
        pages = torch.tensor(seq.block_table)
        for i, (k, v) in enumerate(
            zip(
                [c.k_cache for c in engine.kv_pool.caches],
                [c.v_cache for c in engine.kv_pool.caches],
                strict=True,
            )
        ):
            k_amax[i] = torch.maximum(k_amax[i], k[pages].flatten(0, 1)[: len(prompt)].abs().max())
            v_amax[i] = torch.maximum(v_amax[i], v[pages].flatten(0, 1)[: len(prompt)].abs().max())
        engine.block_manager.deallocate(seq)
    scales = {}
    for i in range(len(k_amax)):
        scales[f"model.layers.{i}.self_attn.k_scale"] = (
            (k_amax[i] / FP8_E4M3_MAX).reshape(1).to(torch.bfloat16)
        )
        scales[f"model.layers.{i}.self_attn.v_scale"] = (
            (v_amax[i] / FP8_E4M3_MAX).reshape(1).to(torch.bfloat16)
        )
    return scales


def with_kv_scales(source: Path, out: Path, scales: dict[str, torch.Tensor]) -> Path:
    """Copy `source` to `out` adding the scales in their own shard and `kv_cache_scheme` (per tensor)."""
    shutil.copytree(source, out)
    save_file(scales, str(out / "kv_scales.safetensors"))
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({name: "kv_scales.safetensors" for name in scales})
        index_path.write_text(json.dumps(index, indent=2))
    config = json.loads((out / "config.json").read_text())
    quantization_config = config.setdefault("quantization_config", {"quant_method": "compressed-tensors"})
    quantization_config["kv_cache_scheme"] = {
        "num_bits": 8,
        "type": "float",
        "strategy": "tensor",
        "dynamic": False,
        "symmetric": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
