"""kvq: compress checkpoints to INT4, calibrate FP8 KV scales, serve them from a checked paged KV pool."""

import os

# MKL's fp32 GEMMs on AVX-512 Intel CPUs take paths that depend on the operands' memory alignment, so the
# same request in the same batch could get other fp32 logits from one run to the next; strict
# reproducibility (MKL's CNR) keeps fp32 reference mode's bit-for-bit promises (the integrity drill's
# "everyone else's logits identical", greedy equality) on every x86 machine. Set before MKL's first call;
# a user's own MKL_CBWR wins. The fast paths (bf16, INT4) run oneDNN and kvq's kernels, not MKL's sgemm.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

__version__ = "0.1.0"
