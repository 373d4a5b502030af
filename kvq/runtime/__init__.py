"""kvq runtime: serve compressed checkpoints (INT4 pack-quantized weights, FP8 or BF16 paged KV cache).

Orchestration code here never imports Triton; only `kvq.runtime.kernels` does, lazily.
"""
