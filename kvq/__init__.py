"""kvq: compress FP8/BF16 checkpoints to INT4, calibrate FP8 KV scales, and serve them from a checked paged KV pool."""

__version__ = "0.1.0"
