"""The peak-memory bound `kvq compress --method gptq` prints: one layer, never the model.

Phase 1 (one process) holds, at its largest layer: torch + transformers (`PROCESS_BASE_BYTES`), every
sample's hidden states twice (the carried states and, in a MoE layer, the routed experts' recorded
inputs), one sample's forward transients (attention scores, MLP activations), the layer's weights in
the compute dtype plus the largest module being read and dequantized, the input Hessians of the layer's
Linears (fp32, one expert's at a time), GPTQ's working set for the largest weight, and the layer's
quantized outputs. GPTAQ adds the full-precision model's hidden states, one sample's inputs to the
Linears in it, and a second `[in, in]` sum per Hessian (`(X_fp - X)^T X`); true-sequential GPTAQ a
copy of the layer's dense targeted weights (the original ones, while later groups calibrate). Phase 2
is `kvq compress`'s shard writing (`runner.peak_rss_bound`). Arithmetic over the plan and the config.
"""

from __future__ import annotations

from kvq.checkpoint.reader import Checkpoint
from kvq.compress.runner import PROCESS_BASE_BYTES, peak_rss_bound
from kvq.compress.tensor_plan import CompressPlan
from kvq.gptq.targets import LayerTargets, int4_shapes

TORCH_TRANSFORMERS_BYTES = 640 * 1024**2  # measured ~0.46 GiB after imports, a model on meta, a tokenizer
ACTIVATION_BYTES = {"bfloat16": 2, "float32": 4}


def gptq_peak_bound(
    lm: Checkpoint,
    fields: dict,
    plan: CompressPlan,
    targets: list[LayerTargets],
    layer_names: list[list[str]],
    num_tokens: tuple[int, int],
    dtype: str,
    workers: int,
    gptaq: bool = False,
    true_sequential: bool = False,
) -> int:
    """Upper estimate of the process tree's peak RSS over both phases of a GPTQ run. `lm`: the language
    model's tensors in transformers' names (those of `layer_names`); `fields`: its config.json fields."""
    num_samples, seq_len = num_tokens
    config = fields
    act = ACTIVATION_BYTES[dtype]
    hidden = int(config["hidden_size"])
    heads = int(config.get("num_attention_heads") or 1)
    widest = max(hidden, *(int(config.get(k) or 0) for k in ("intermediate_size", "moe_intermediate_size")))
    states = (3 if gptaq else 2) * num_samples * seq_len * hidden * act
    transients = 2 * 4 * heads * seq_len * seq_len + (20 if gptaq else 16) * seq_len * widest * act
    shapes = int4_shapes(plan)
    largest_layer = 0
    for names, layer in zip(layer_names, targets, strict=True):
        weights = sum(lm.tensors[n].numel * act for n in names if not n.endswith("_scale_inv"))
        read = max((lm.tensors[n].numel * (4 + 4) for n in names), default=0)
        dense = sum(shapes[t.name][1] ** 2 * 4 for t in layer.linears) * (2 if gptaq else 1)
        if gptaq and true_sequential:
            dense += sum(shapes[t.name][0] * shapes[t.name][1] * act for t in layer.linears)
        expert = max((shapes[t.name][1] ** 2 * 4 for t in layer.experts), default=0) * 2
        names = [t.name for t in layer.linears] + [t.name for t in layer.experts]
        gptq = max((_gptq_bytes(shapes[n]) for n in names), default=0)
        staged = sum(shapes[n][0] * shapes[n][1] for n in names)
        largest_layer = max(largest_layer, weights + read + dense + expert + gptq + staged)
    phase1 = TORCH_TRANSFORMERS_BYTES + states + transients + largest_layer
    return max(phase1 + PROCESS_BASE_BYTES, peak_rss_bound(plan, workers) + TORCH_TRANSFORMERS_BYTES)


def _gptq_bytes(shape: tuple[int, ...]) -> int:
    """GPTQ on one `[out, in]` weight: fp32 weight copies and error updates, codes, Hessian copies."""
    rows, cols = shape
    return 4 * rows * cols * 4 + rows * cols + 6 * cols * cols * 4
