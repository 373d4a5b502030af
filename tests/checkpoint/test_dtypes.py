"""The torch-free dtype table (headers, plans) agrees with torch's dtypes."""

from __future__ import annotations

from kvq.checkpoint.dtypes import ITEMSIZES
from kvq.checkpoint.torch_dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS


def test_every_code_has_the_torch_itemsize() -> None:
    assert SAFETENSORS_DTYPES.keys() == ITEMSIZES.keys()
    assert {code: dtype.itemsize for code, dtype in SAFETENSORS_DTYPES.items()} == ITEMSIZES
    assert all(TORCH_TO_SAFETENSORS[dtype] == code for code, dtype in SAFETENSORS_DTYPES.items())
