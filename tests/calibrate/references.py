"""Independent references for KV scales: a plain whole-model transformers forward, and llm-compressor oneshot.

`cache_amax` runs the whole model with transformers' own `DynamicCache` and reads back what it cached
(post-RoPE K/V; for MLA the RoPE'd key part) plus, for MLA, the `kv_a_layernorm` output through a hook.
`oneshot_scales` runs llm-compressor with a `kv_cache_scheme` (observer static_minmax) on the same ids.
`dense_copy` writes a checkpoint's weights dequantized by kvq as a plain BF16 folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from kvq.calibrate.observed_kv import ObservedKV
from kvq.checkpoint.dense import read_dense
from kvq.checkpoint.reader import Checkpoint
from kvq.checkpoint.write import save_safetensors_atomic, write_json_atomic


def cache_amax(
    model_dir: Path, input_ids: torch.Tensor, layout: ObservedKV
) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, per KV head amax of what transformers caches (`k`, `v`; MLA: `kv_c`, `k_pe`)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return model_cache_amax(model, input_ids, layout)


def model_cache_amax(
    model: PreTrainedModel, input_ids: torch.Tensor, layout: ObservedKV
) -> dict[int, dict[str, torch.Tensor]]:
    """`cache_amax` of a model already in memory."""
    amax: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(layout.num_layers)}

    def keep(i: int, name: str, value: torch.Tensor) -> None:
        value = value.float()
        amax[i][name] = value if name not in amax[i] else torch.maximum(amax[i][name], value)

    hooks = []
    if layout.is_mla:
        for i, layer in enumerate(model.model.layers):
            hooks.append(
                layer.self_attn.kv_a_layernorm.register_forward_hook(
                    lambda _m, _a, out, i=i: keep(i, "kv_c", out.abs().amax().reshape(1))
                )
            )
    with torch.no_grad():
        for row in input_ids:
            cache = DynamicCache(config=model.config)
            model(row.unsqueeze(0), past_key_values=cache, use_cache=True)
            for i, cached in enumerate(cache.layers[: layout.num_layers]):
                if layout.is_mla:
                    keep(i, "k_pe", cached.keys[:, :, :, layout.qk_nope_head_dim :].abs().amax().reshape(1))
                else:
                    keep(i, "k", cached.keys.abs().amax(dim=(0, 2, 3)))
                    keep(i, "v", cached.values.abs().amax(dim=(0, 2, 3)))
    for hook in hooks:
        hook.remove()
    return amax


def oneshot_scales(
    model_dir: Path, input_ids: torch.Tensor, strategy: str, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """k_scale / v_scale of llm-compressor oneshot (kv_cache_scheme, static_minmax) on exactly `input_ids`."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    batches = [
        {"input_ids": row.unsqueeze(0), "attention_mask": torch.ones_like(row).unsqueeze(0)}
        for row in input_ids
    ]
    scheme = QuantizationArgs(
        num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True, observer="static_minmax"
    )
    oneshot(
        model=model,
        dataset=torch.utils.data.DataLoader(batches, batch_size=None),
        recipe=QuantizationModifier(kv_cache_scheme=scheme),
        num_calibration_samples=len(batches),
        max_seq_length=input_ids.shape[1],
        shuffle_calibration_samples=False,
    )
    return {
        name: p.detach().clone()
        for name, p in model.named_parameters()
        if name.endswith(("k_scale", "v_scale"))
    }


def dense_copy(src: Path, dst: Path) -> Path:
    """`src`'s weights dequantized by `read_dense` into one BF16 model.safetensors, plus config, tokenizer."""
    ckpt = Checkpoint.open(src)
    dst.mkdir(parents=True)
    save_safetensors_atomic(read_dense(ckpt, "", torch.bfloat16), dst / "model.safetensors")
    write_json_atomic(
        {k: v for k, v in ckpt.config.items() if k != "quantization_config"}, dst / "config.json"
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dst / name)
    return dst
