"""The W4A16 pack layout against compressed-tensors' own pack/unpack (the oracle, a dependency of kvq).

Kept apart from test_w4a16.py because the GPU machine has no compressed-tensors: scripts/gpu_check.sh
names this file in its --ignore list (checked by test_gpu_check_imports.py)."""

from __future__ import annotations

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from kvq.formats.pack_quantized import pack_int4, unpack_int4


def test_unpack_matches_compressed_tensors_both_ways() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (37, 96), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(q, 4)
    assert packed.dtype == torch.int32 and packed.shape == (37, 12)
    assert torch.equal(pack_int4(q), packed)  # what kernel_cases packs the tests' weights with
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(unpack_int4(torch.stack([packed, packed])), torch.stack([q, q]))
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([37, 96])), q)


def test_pack_layout_first_element_in_lowest_bits() -> None:
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, 7]], dtype=torch.int8)  # nibbles 0..6, 15
    word = sum((int(v) + 8) << (4 * j) for j, v in enumerate(q[0]))
    expected = torch.tensor([[word - (1 << 32)]], dtype=torch.int32)  # top nibble 15 sets the sign bit
    assert torch.equal(pack_to_int32(q, 4), expected)
    assert torch.equal(unpack_int4(expected), q)
