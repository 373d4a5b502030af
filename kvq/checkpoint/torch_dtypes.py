"""The torch dtype of each safetensors dtype code in `kvq.checkpoint.dtypes`, and back."""

from __future__ import annotations

import torch

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}
