"""shard_layout reproduces safetensors' serializer byte for byte, before any tensor exists."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import save

from kvq.checkpoint.torch_dtypes import TORCH_TO_SAFETENSORS
from kvq.compress.safetensors_layout import shard_layout
from kvq.compress.tensor_plan import OutputTensor
from kvq.compress.torch_quantize import tensor_bytes

DTYPES = [
    torch.int64,
    torch.float64,
    torch.float32,
    torch.int32,
    torch.bfloat16,
    torch.float16,
    torch.int16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def random_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(40):
        dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=gen))]
        shape = tuple(
            int(d)
            for d in torch.randint(1, 9, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen)
        )
        name = f"model.layers.{int(torch.randint(100, (1,), generator=gen))}.t{i}.weight"
        out[name] = torch.randint(0, 2, shape, generator=gen).to(dtype)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_header_and_offsets_equal_save_file(seed):
    tensors = random_tensors(seed)
    expected = save(tensors, metadata={"format": "pt"})
    layout = shard_layout(
        [OutputTensor(n, TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    )
    assert layout.header == expected[: len(layout.header)]
    assert layout.file_bytes == len(expected)
    rebuilt = bytearray(layout.file_bytes)
    rebuilt[: len(layout.header)] = layout.header
    for name, tensor in tensors.items():
        data = bytes(tensor_bytes(tensor))
        rebuilt[layout.offsets[name] : layout.offsets[name] + len(data)] = data
    assert bytes(rebuilt) == expected


def test_header_is_padded_to_eight_bytes():
    layout = shard_layout([OutputTensor("a", "F32", (3,))])
    (length,) = struct.unpack("<Q", layout.header[:8])
    assert length % 8 == 0 and len(layout.header) == 8 + length
    assert layout.tensor_bytes == 12
