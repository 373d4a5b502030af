"""The integrity check kernels: the Triton tag compare and sampled-bytes hash give the torch reference's
values bit for bit on irregular shapes (under Triton's interpreter here: tests/conftest.py sets
TRITON_INTERPRET=1), the reference agrees with a plain loop, and a change of any one sampled byte
changes the hash."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.integrity.page_sample import make_page_sample
from kvq.runtime.kernels.integrity_check import (
    check_page_tags,
    check_page_tags_reference,
    sampled_page_hash,
    sampled_page_hash_reference,
)
from kvq.runtime.kernels.integrity_check_triton import check_page_tags_triton, sampled_page_hash_triton


def tag_case(num_pages: int, num_entries: int, ids_dtype: torch.dtype, seed: int):
    """Tags over the whole int64 range; ids in range, -1 padding and past the end; expectations that
    match, mismatch, or are 0 (unchecked)."""
    gen = torch.Generator().manual_seed(seed)
    page_tags = torch.randint(-(1 << 62), 1 << 62, (num_pages,), generator=gen) * 2 + 1
    page_ids = torch.randint(-1, num_pages + 3, (num_entries,), generator=gen).to(ids_dtype)
    matching = page_tags[page_ids.long().clamp(0, num_pages - 1)]
    other = torch.randint(-(1 << 62), 1 << 62, (num_entries,), generator=gen)
    kind = torch.randint(0, 3, (num_entries,), generator=gen)
    expected = torch.where(kind == 0, matching, torch.where(kind == 1, other, torch.zeros_like(other)))
    return page_tags, page_ids, expected


def tags_by_loop(page_tags: torch.Tensor, page_ids: torch.Tensor, expected: torch.Tensor) -> list[bool]:
    tags, out = page_tags.tolist(), []
    for page, want in zip(page_ids.tolist(), expected.tolist(), strict=True):
        out.append(want != 0 and not (0 <= page < len(tags) and tags[page] == want))
    return out


@pytest.mark.parametrize(
    ("num_pages", "num_entries", "ids_dtype"), [(37, 1003, torch.int64), (5, 7, torch.int32)]
)
def test_tag_check_triton_matches_the_reference(
    num_pages: int, num_entries: int, ids_dtype: torch.dtype
) -> None:
    page_tags, page_ids, expected = tag_case(num_pages, num_entries, ids_dtype, seed=num_entries)
    reference = check_page_tags_reference(page_tags, page_ids, expected)
    assert reference.tolist() == tags_by_loop(page_tags, page_ids, expected)
    assert 0 < int(reference.sum()) < num_entries
    assert torch.equal(check_page_tags_triton(page_tags, page_ids, expected), reference)
    assert torch.equal(check_page_tags(page_tags, page_ids, expected, backend="torch"), reference)


def test_tag_check_of_nothing_is_empty() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    assert check_page_tags_triton(torch.ones(3, dtype=torch.int64), empty, empty).shape == (0,)


def hash_case(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, seed: int):
    """A bf16 pool's byte view `[L, 2, P + 1, page_size * row_bytes]` of random bytes, and its sample."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.empty(
        num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16
    )
    pool_bytes = storage.view(torch.uint8).view(num_layers, 2, num_pages + 1, -1)
    pool_bytes.copy_(torch.randint(0, 256, pool_bytes.shape, generator=gen, dtype=torch.uint8))
    row_bytes = num_kv_heads * head_dim * 2
    sample = make_page_sample(num_layers, page_size, row_bytes, torch.device("cpu"), seed=seed)
    return pool_bytes, sample


def hash_by_loop(pool_bytes: torch.Tensor, page: int, offsets: list[int], coeffs: torch.Tensor) -> int:
    total = 0
    for layer in range(pool_bytes.shape[0]):
        for half in range(2):
            for s, offset in enumerate(offsets):
                total += int(pool_bytes[layer, half, page, offset]) * int(coeffs[layer, half, s])
    return total


@pytest.mark.parametrize(
    ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"), [(3, 11, 5, 3, 37), (1, 2, 1, 1, 8)]
)
def test_sampled_hash_triton_matches_the_reference(
    num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> None:
    pool_bytes, sample = hash_case(num_layers, num_pages, page_size, num_kv_heads, head_dim, seed=head_dim)
    page_ids = torch.tensor([num_pages - 1, 0, 1, 0, num_pages][: num_pages + 1], dtype=torch.int64)
    reference = sampled_page_hash_reference(pool_bytes, page_ids, sample.offsets, sample.coeffs)
    offsets = sample.offsets.tolist()
    assert reference.tolist() == [
        hash_by_loop(pool_bytes, p, offsets, sample.coeffs) for p in page_ids.tolist()
    ]
    assert torch.equal(
        sampled_page_hash_triton(pool_bytes, page_ids, sample.offsets, sample.coeffs), reference
    )
    assert torch.equal(sampled_page_hash(pool_bytes, page_ids, sample.offsets, sample.coeffs), reference)


def test_any_one_sampled_byte_changes_the_hash() -> None:
    pool_bytes, sample = hash_case(3, 4, 5, 3, 37, seed=1)
    page = torch.tensor([2])
    before = int(sampled_page_hash_reference(pool_bytes, page, sample.offsets, sample.coeffs))
    for layer in range(3):
        for half in range(2):
            for offset in sample.offsets.tolist():
                saved = int(pool_bytes[layer, half, 2, offset])
                for flipped in (saved ^ 0x80, saved ^ 0x01, 255 - saved if saved != 127 else 0):
                    pool_bytes[layer, half, 2, offset] = flipped
                    after = int(sampled_page_hash_reference(pool_bytes, page, sample.offsets, sample.coeffs))
                    assert after != before, (layer, half, offset, flipped)
                pool_bytes[layer, half, 2, offset] = saved


def test_the_sample_covers_every_slot_of_a_page() -> None:
    sample = make_page_sample(
        num_layers=4, page_size=6, row_bytes=50, device=torch.device("cpu"), samples_per_slot=3
    )
    offsets = sample.offsets.tolist()
    assert len(offsets) == len(set(offsets)) == 18 and all(0 <= o < 6 * 50 for o in offsets)
    assert sorted({o // 50 for o in offsets}) == list(range(6))  # every token slot, three bytes each
    assert sample.coeffs.shape == (4, 2, 18) and bool((sample.coeffs % 2 == 1).all())
    with pytest.raises(ValueError, match="samples_per_slot"):
        make_page_sample(1, 2, 3, torch.device("cpu"), samples_per_slot=4)


def test_bad_inputs_are_named() -> None:
    tags = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(TypeError, match="int64"):
        check_page_tags_reference(
            tags.int(), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        )
    with pytest.raises(ValueError, match=r"\[P\], \[N\] and \[N\]"):
        check_page_tags_reference(tags, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    pool_bytes, sample = hash_case(2, 3, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="coeffs has shape"):
        sampled_page_hash_reference(pool_bytes, torch.tensor([0]), sample.offsets, sample.coeffs[:1])
