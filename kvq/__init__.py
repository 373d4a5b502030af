"""kvq: compress checkpoints to INT4, calibrate FP8 KV scales, serve them from a checked paged KV pool."""

__version__ = "0.1.0"
