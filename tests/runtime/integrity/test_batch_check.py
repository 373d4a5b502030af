"""The whole per-step check as one C call (`kernels.integrity.batch_check`): on irregular shapes it answers
as the torch reference (the step check, the stamp check and full mode's page hashes composed) and writes
the same write tags and slot stamps, clean and under each single fault; it binds only pools it can read
and declines batches it cannot, so the caller checks part by part."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.integrity.page_sample import make_page_sample
from kvq.runtime.kernels.integrity.batch_check import (
    NO_BYTE_HASH,
    BatchCheck,
    BatchTensors,
    PageHashes,
    check_batch_reference,
)
from kvq.runtime.kernels.integrity.page_check import sampled_page_hash_reference
from tests.runtime.integrity.test_check_kernels import random_tables


def batch_case(num_pages: int, lens: list[int], query_lens: list[int], page_size: int, num_layers: int):
    """A consistent checked step: the pool (tags, stamps of every slot read, bytes and their recorded
    hashes), the batch tensors, the flat expectations (`TagTracker._expected`'s layout) and the sealed
    pages the step reads."""
    gen = torch.Generator().manual_seed(num_pages)
    page_tags, block_tables = random_tables(gen, num_pages, lens, page_size)
    tables = block_tables.tolist()
    held = block_tables >= 0
    expected_tags = torch.where(held, page_tags[block_tables.long().clamp(min=0)], 0)
    writers = torch.where(held, torch.randint(1, 1 << 62, block_tables.shape, generator=gen), 0)
    stamps = torch.zeros(num_pages + 1, page_size, num_layers, dtype=torch.int64)
    rows, positions, read_lens = [], [], [n - q for n, q in zip(lens, query_lens, strict=True)]
    for b, (n, q) in enumerate(zip(lens, query_lens, strict=True)):
        rows += [b] * q
        positions += range(n - q, n)
        for p in range(n - q):
            stamps[tables[b][p // page_size], p % page_size] = int(writers[b, p // page_size]) ^ p
    slots = [
        tables[b][p // page_size] * page_size + p % page_size for b, p in zip(rows, positions, strict=True)
    ]
    batch = BatchTensors(
        block_tables, torch.tensor(lens, dtype=torch.int32), torch.tensor(positions), torch.tensor(slots)
    )
    expected = (
        expected_tags.flatten().tolist() + lens + rows + positions + writers.flatten().tolist() + read_lens
    )
    storage = torch.randint(0, 256, (num_layers, 2, num_pages + 1, page_size * 6), generator=gen)
    pool_bytes = storage.to(torch.uint8)
    sample = make_page_sample(num_layers, page_size, 6, torch.device("cpu"), seed=num_pages)
    sealed = [tables[b][j] for b, n in enumerate(read_lens) for j in range(n // page_size)]
    byte_hashes = torch.full((num_pages,), NO_BYTE_HASH, dtype=torch.int64)
    recorded = torch.tensor(sealed[1:], dtype=torch.int64)  # the first sealed page: not hashed yet
    byte_hashes[recorded] = sampled_page_hash_reference(pool_bytes, recorded, sample.offsets, sample.coeffs)
    hashes = PageHashes(pool_bytes, sample.offsets, sample.coeffs, byte_hashes)
    return page_tags, batch, expected, stamps, hashes, sealed


def faults(
    page_tags, batch: BatchTensors, expected: list[int], stamps, hashes: PageHashes, sealed: list[int]
):
    """(name, the case with that one fault): every part of the check must see each."""
    num_rows, width = batch.block_tables.shape
    num_tokens = batch.positions.shape[0]
    read = next(b for b in range(num_rows) if expected[2 * num_rows * width + num_rows + 2 * num_tokens + b])

    def case(**changed):
        parts = dict(batch=batch, expected=expected, stamps=stamps, hashes=hashes, sealed=sealed)
        return parts | changed

    table = batch.block_tables.clone()
    table[0, 0] = int(table[-1, 0])  # another request's page
    yield "read", case(batch=batch._replace(block_tables=table))
    lens = batch.context_lens.clone()
    lens[-1] += 1
    yield "length", case(batch=batch._replace(context_lens=lens))
    slots = batch.slot_mapping.clone()
    slots[-1] += 1
    yield "slot", case(batch=batch._replace(slot_mapping=slots))
    positions = batch.positions.clone()
    positions[0] -= 1
    yield "position", case(batch=batch._replace(positions=positions))
    wrong = list(expected)
    wrong[num_rows * width - 1 if width > 1 else 0] ^= 4
    yield "expectation", case(expected=wrong)
    flipped = stamps.clone()
    flipped[int(batch.block_tables[read, 0]), 0, -1] ^= 1 << 40  # the first slot row `read` reads
    yield "stamp", case(stamps=flipped)
    if len(sealed) > 1:
        pool_bytes = hashes.pool_bytes.clone()
        pool_bytes[0, 1, sealed[-1], int(hashes.offsets[-1])] ^= 1
        yield "bytes", case(hashes=hashes._replace(pool_bytes=pool_bytes))
    yield "no page", case(sealed=[*sealed, page_tags.shape[0]])


@pytest.mark.parametrize(
    ("num_pages", "lens", "query_lens", "page_size", "num_layers"),
    [
        (97, [17, 4, 33, 1, 29], [17, 1, 1, 1, 9], 4, 3),
        (40, [5, 16, 9, 40], [1, 1, 1, 1], 16, 30),
        (9, [3, 2], [1, 1], 1, 1),
    ],
)
def test_the_c_call_answers_as_the_reference_clean_and_under_each_fault(
    num_pages: int, lens: list[int], query_lens: list[int], page_size: int, num_layers: int
) -> None:
    page_tags, batch, expected, stamps, hashes, sealed = batch_case(
        num_pages, lens, query_lens, page_size, num_layers
    )
    expected_t = torch.tensor(expected, dtype=torch.int64)
    clean = check_batch_reference(page_tags, batch, page_size, expected_t, stamps, hashes, sealed)
    assert clean[0] is False
    cases = [("clean", dict(batch=batch, expected=expected, stamps=stamps, hashes=hashes, sealed=sealed))]
    cases += list(faults(page_tags, batch, expected, stamps, hashes, sealed))
    assert len(cases) >= 8
    for name, c in cases:
        for has_stamps, has_hashes in ((True, True), (True, False), (False, False)):
            stamps_c, hashes_c = c["stamps"] if has_stamps else None, c["hashes"] if has_hashes else None
            wanted = check_batch_reference(
                page_tags, c["batch"], page_size, torch.tensor(c["expected"]), stamps_c, hashes_c, c["sealed"]
            )
            check = BatchCheck(page_tags, page_size, stamps_c, hashes_c)
            assert check.applies
            found = check(c["batch"], c["expected"], c["sealed"])
            assert found is not None
            assert found[0] == wanted[0], (name, has_stamps, has_hashes)
            assert torch.equal(found[1], wanted[1])
            assert (found[2] is None) == (wanted[2] is None) == (not has_stamps)
            if has_stamps:
                assert torch.equal(found[2], wanted[2])
            is_seen = name in ("read", "length", "slot", "position", "expectation")
            is_seen |= has_stamps and name == "stamp"
            is_seen |= has_hashes and name in ("bytes", "no page")
            assert found[0] == is_seen, (name, has_stamps, has_hashes)


def test_it_binds_only_pools_it_reads_and_declines_batches_it_cannot() -> None:
    page_tags, batch, expected, stamps, hashes, sealed = batch_case(40, [5, 16, 9], [1, 1, 1], 16, 3)
    assert not BatchCheck(page_tags, 16, stamps[..., :2], None).applies  # an MTP pool's view: not contiguous
    assert not BatchCheck(page_tags, 8, stamps, None).applies  # stamps of another page size
    assert not BatchCheck(page_tags.int(), 16, stamps, None).applies
    assert not BatchCheck(page_tags, 16, stamps, None, backend="triton").applies
    check = BatchCheck(page_tags, 16, stamps, hashes)
    assert check(batch, expected[:-1], sealed) is None  # the expectations of another batch
    wide = torch.full((3, 8), -1, dtype=torch.int32)[:, :3]
    wide.copy_(batch.block_tables)
    assert check(batch._replace(block_tables=wide), expected, sealed) is None  # rows not contiguous
    assert check(batch._replace(positions=batch.positions.int()), expected, sealed) is None
    answer = check(batch, expected, sealed)
    assert answer is not None and answer[0] is False
