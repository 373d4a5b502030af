"""Perplexity of a whole-model transformers forward with K/V stored in FP8 (fake-quantized) or not.

Used by `kvq bench calibrate` to show what calibrated scales buy over the 1.0 fallback on a small real
model (SmolLM2). Evaluation windows come from `build_samples` on held-out text, so they never overlap the
calibration articles. GQA models only (the whole model must fit in memory).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from kvq.calibrate.fake_quant import FakeQuantKVCache, KvScales


def load_reference_model(path: Path, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """The whole model in memory (eval mode) for a reference forward."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def perplexity(model: PreTrainedModel, input_ids: torch.Tensor, kv_scales: KvScales | None) -> float:
    """exp(mean next-token NLL) over windows `input_ids` `[N, S]`; K/V fake-quantized when `kv_scales`."""
    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for row in input_ids:
            ids = row.unsqueeze(0)  # [1, S]
            cache = (
                DynamicCache(config=model.config)
                if kv_scales is None
                else FakeQuantKVCache(model.config, kv_scales)
            )
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, :-1].float()  # [S-1, V]
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
            total_nll += nll.item()
            total_tokens += ids.shape[1] - 1
    return math.exp(total_nll / total_tokens)
