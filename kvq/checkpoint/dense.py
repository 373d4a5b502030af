"""Read tensors from any checkpoint format as plain dense weights (quantization undone, metadata dropped).

Handles BF16/FP16/FP32, FP8-block (`weight` + `weight_scale_inv`), compressed-tensors float-quantized FP8
(`weight` + `weight_scale`, per-tensor / per-channel / block) and pack-quantized INT4 (`weight_packed` +
`weight_scale` + `weight_shape`). Used wherever a reference forward needs real-valued weights: calibration,
evaluation, and the oracle tests of the runtime.
"""

from __future__ import annotations

import torch

from kvq.checkpoint.reader import Checkpoint, block_size
from kvq.errors import KvqError
from kvq.formats.fp8_block import dequantize_fp8_block
from kvq.formats.pack_quantized import dequantize_pack_quantized

_DROPPED = ("weight_scale_inv", "weight_scale", "weight_shape", "weight_zero_point", "input_scale")


def dequantize_float_quantized(
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """compressed-tensors FP8 `weight` with a tensor, channel (`[M, 1]`) or block scale -> dense."""
    if weight_scale.numel() == 1 or (
        weight_scale.ndim == 2 and weight_scale.shape[1] == 1 and weight_scale.shape[0] == weight.shape[0]
    ):
        return (weight.to(torch.float32) * weight_scale.to(torch.float32)).to(dtype)
    return dequantize_fp8_block(weight, weight_scale, block, dtype)


def read_dense(ckpt: Checkpoint, prefix: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, with quantized weights turned into dense `.weight`.

    Floating-point tensors are cast to `dtype`; quantization metadata is consumed, not returned.
    """
    names = [n for n in ckpt.tensors if n.startswith(prefix)]
    raw = ckpt.read_many(names)
    block = block_size(ckpt)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in raw.items():
        module, _, param = name.rpartition(".")
        try:
            if param == "weight_packed":
                out[f"{module}.weight"] = dequantize_pack_quantized(
                    tensor, raw[f"{module}.weight_scale"], raw[f"{module}.weight_shape"].tolist(), dtype
                )
            elif param == "weight" and tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                if f"{module}.weight_scale_inv" in raw:
                    out[name] = dequantize_fp8_block(tensor, raw[f"{module}.weight_scale_inv"], block, dtype)
                else:
                    out[name] = dequantize_float_quantized(
                        tensor, raw[f"{module}.weight_scale"], block, dtype
                    )
            elif param not in _DROPPED:
                out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        except KeyError as e:
            raise KvqError(
                f"{ckpt.root}: tensor {name!r} has no companion {e.args[0]!r}; the checkpoint is "
                f"incomplete (check the index and shards)"
            ) from None
        except ValueError as e:
            raise KvqError(f"{ckpt.root}: cannot dequantize {name!r}: {e}") from None
    return out
