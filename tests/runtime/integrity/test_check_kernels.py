"""The integrity check kernels: the Triton step check (page tags, context lengths, positions and slots)
and sampled-bytes hash give the torch reference's values bit for bit on irregular shapes with faults of
every kind (under Triton's interpreter here: tests/conftest.py sets TRITON_INTERPRET=1), the references
agree with plain loops, the write guard skips exactly the writes whose page moved on, and a change of
any one sampled byte changes the hash."""

from __future__ import annotations

import pytest
import torch

from kvq.runtime.integrity.page_sample import make_page_sample
from kvq.runtime.kernels.integrity.cpu_calls import (
    check_step_native,
    guard_applies,
    guard_native,
    page_hash_applies,
    sampled_page_hash_native,
    step_check_applies,
)
from kvq.runtime.kernels.integrity.page_check import sampled_page_hash, sampled_page_hash_reference
from kvq.runtime.kernels.integrity.step_check import (
    StepCheckInputs,
    check_step,
    check_step_reference,
    guard_slot_mapping,
)
from kvq.runtime.kernels.triton.page_check import sampled_page_hash_triton
from kvq.runtime.kernels.triton.step_check import check_step_triton


def random_tables(
    gen: torch.Generator, num_pages: int, lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(random odd tags of `num_pages` pages, block tables int32 `[B, width]` holding distinct random pages
    for requests of `lens` tokens, padded with -1)."""
    page_tags = torch.randint(-(1 << 62), 1 << 62, (num_pages,), generator=gen) * 2 + 1
    num_held = [-(-n // page_size) for n in lens]
    width = max(num_held)
    order = torch.randperm(num_pages, generator=gen).tolist()
    tables, taken = [], 0
    for n in num_held:
        tables.append(order[taken : taken + n] + [-1] * (width - n))
        taken += n
    return page_tags, torch.tensor(tables, dtype=torch.int32)


def step_case(num_pages: int, lens: list[int], query_lens: list[int], page_size: int, seed: int):
    """A step over requests of `lens` tokens (the last `query_lens` new), each on distinct random pages
    carrying random tags, as `prepare` would lay it out (padding -1): the batch tensors and the
    expectations, all consistent."""
    gen = torch.Generator().manual_seed(seed)
    page_tags, block_tables = random_tables(gen, num_pages, lens, page_size)
    tables = block_tables.tolist()
    expected_tags = torch.where(block_tables >= 0, page_tags[block_tables.long().clamp(min=0)], 0)
    rows, positions = [], []
    for b, (n, q) in enumerate(zip(lens, query_lens, strict=True)):
        rows += [b] * q
        positions += range(n - q, n)
    slots = [
        tables[b][p // page_size] * page_size + p % page_size for b, p in zip(rows, positions, strict=True)
    ]
    batch = {
        "page_tags": page_tags,
        "block_tables": block_tables,
        "context_lens": torch.tensor(lens, dtype=torch.int32),
        "positions": torch.tensor(positions),
        "slot_mapping": torch.tensor(slots),
        "expected_tags": expected_tags,
        "expected_lens": torch.tensor(lens),
        "token_rows": torch.tensor(rows),
        "expected_positions": torch.tensor(positions),
    }
    return batch, gen


def step_by_loop(c: dict, page_size: int) -> tuple[list[bool], list[int]]:
    """The spec of `check_step`, entry by entry in plain Python."""
    tags, table, expected = c["page_tags"].tolist(), c["block_tables"].tolist(), c["expected_tags"].tolist()
    bad = []
    for row, want_row in zip(table, expected, strict=True):
        for page, want in zip(row, want_row, strict=True):
            in_range = 0 <= page < len(tags)
            bad.append(page != -1 if want == 0 else not (in_range and tags[page] == want))
    bad += [a != b for a, b in zip(c["context_lens"].tolist(), c["expected_lens"].tolist(), strict=True)]
    write_tags = []
    columns = zip(
        c["token_rows"].tolist(), c["expected_positions"].tolist(), c["positions"].tolist(),
        c["slot_mapping"].tolist(), strict=True,
    )  # fmt: skip
    for row, position, found_position, slot in columns:
        index = position // page_size
        is_index = position >= 0 and 0 <= row < len(table) and index < len(table[0])
        page = table[row][index] if is_index else -1
        bad.append(found_position != position or page < 0 or slot != page * page_size + position % page_size)
        write_tags.append(expected[row][index] if is_index else 0)
    return bad, write_tags


def corrupt(c: dict, gen: torch.Generator, num_pages: int) -> None:
    """A few faults of every kind the check must see, in place."""

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    table = c["block_tables"]
    b = pick(table.shape[0])
    table[b, pick(int((table[b] >= 0).sum()))] = pick(num_pages)  # another page (maybe its own: fine)
    table[pick(table.shape[0]), table.shape[1] - 1] = num_pages + 2  # past the pool, or past its pages
    c["context_lens"][pick(table.shape[0])] += 1
    num_tokens = c["positions"].shape[0]
    c["slot_mapping"][pick(num_tokens)] += 1  # one slot off, maybe inside the right page
    c["positions"][pick(num_tokens)] -= 1
    c["expected_tags"][pick(table.shape[0]), 0] ^= 4  # an expectation the page does not meet


@pytest.mark.parametrize(
    ("num_pages", "lens", "query_lens", "page_size"),
    [(97, [17, 4, 33, 1, 29], [17, 4, 1, 1, 9], 4), (40, [5, 16, 9], [1, 1, 1], 16), (9, [3], [3], 1)],
)
def test_step_check_triton_matches_the_reference(
    num_pages: int, lens: list[int], query_lens: list[int], page_size: int
) -> None:
    clean, gen = step_case(num_pages, lens, query_lens, page_size, seed=num_pages)
    is_bad, write_tags, _ = check_step_reference(StepCheckInputs(**clean), page_size=page_size)
    assert not is_bad.any()
    assert write_tags.tolist() == step_by_loop(clean, page_size)[1]
    faulty = {k: v.clone() for k, v in clean.items()}
    corrupt(faulty, gen, num_pages)
    is_bad, write_tags, _ = check_step_reference(StepCheckInputs(**faulty), page_size=page_size)
    bad_by_loop, write_tags_by_loop = step_by_loop(faulty, page_size)
    assert is_bad.tolist() == bad_by_loop and write_tags.tolist() == write_tags_by_loop
    assert 3 <= int(is_bad.sum()) < is_bad.numel()
    for case in (clean, faulty):
        reference = check_step_reference(StepCheckInputs(**case), page_size=page_size)
        triton_out = check_step_triton(StepCheckInputs(**case), page_size=page_size)
        assert all(torch.equal(a, b) for a, b in zip(triton_out, reference[:2], strict=True))
        dispatched = check_step(StepCheckInputs(**case), page_size=page_size, backend="triton")
        assert all(torch.equal(a, b) for a, b in zip(dispatched[:2], reference[:2], strict=True))


@pytest.mark.parametrize(
    ("num_pages", "lens", "query_lens", "page_size", "table_dtype"),
    [
        (97, [17, 4, 33, 1, 29], [17, 4, 1, 1, 9], 4, torch.int32),
        (40, [5, 16, 9], [1, 1, 1], 16, torch.int64),
        (9, [3], [3], 1, torch.int32),
    ],
)
def test_step_check_c_call_matches_the_reference(
    num_pages: int, lens: list[int], query_lens: list[int], page_size: int, table_dtype: torch.dtype
) -> None:
    """The CPU C call (`step_check_native`): the reference's flags, write tags and slot stamps, clean and
    with every kind of fault, and a position outside the table; the guard's C call likewise."""
    clean, gen = step_case(num_pages, lens, query_lens, page_size, seed=num_pages + 1)
    clean["block_tables"] = clean["block_tables"].to(table_dtype)
    faulty = {k: v.clone() for k, v in clean.items()}
    corrupt(faulty, gen, num_pages)
    faulty["expected_positions"][-1] = -3  # an entry before the table: write tag 0, flagged
    writers = torch.randint(1, 1 << 40, clean["block_tables"].shape, generator=gen) << 20
    for case in (clean, faulty):
        inputs = StepCheckInputs(**case)
        assert step_check_applies(inputs, writers) and step_check_applies(inputs, None)
        reference = check_step_reference(inputs, page_size, writers)
        native = check_step_native(inputs, page_size, writers)
        dispatched = check_step(inputs, page_size, writers)
        for found in (native, dispatched):
            assert all(torch.equal(a, b) for a, b in zip(found, reference, strict=True))  # type: ignore[arg-type]
        assert check_step(inputs, page_size)[2] is None
        page_tags, slots, write_tags = case["page_tags"], case["slot_mapping"].clone(), reference[1]
        slots[0] = -1  # a skipped token
        assert guard_applies(page_tags, slots, write_tags)
        guarded = guard_native(page_tags, slots, write_tags, page_size)
        pages = slots.div(page_size, rounding_mode="floor").clamp(0, page_tags.shape[0] - 1)
        assert torch.equal(guarded, torch.where(page_tags[pages] == write_tags, slots, -1))
    assert int(check_step_native(StepCheckInputs(**faulty), page_size)[0].sum()) >= 4


def test_a_slot_one_off_inside_the_right_page_and_a_context_one_too_long_are_seen() -> None:
    """The two faults a page-granular check cannot see (issue #20)."""
    clean, _ = step_case(20, [6, 7], [1, 1], 4, seed=3)
    slot = clean["slot_mapping"].clone()
    slot[0] -= 1  # position 5 -> slot of position 4, the same page
    is_bad, _, _ = check_step_reference(StepCheckInputs(**(clean | {"slot_mapping": slot})), page_size=4)
    assert is_bad.nonzero().flatten().tolist() == [2 * 2 + 2 + 0]
    lens = clean["context_lens"].clone()
    lens[1] += 1
    is_bad, _, _ = check_step_reference(StepCheckInputs(**(clean | {"context_lens": lens})), page_size=4)
    assert is_bad.nonzero().flatten().tolist() == [2 * 2 + 1]


def test_the_guard_skips_writes_whose_page_moved_on() -> None:
    page_tags = torch.tensor([5, 6, 7, 8])
    slots = torch.tensor([1, 6, 9, 14, -1])  # pages 0, 1, 2, 3, skip
    write_tags = torch.tensor([5, 9, 7, 8, 5])  # page 1 carries another tag now
    assert guard_slot_mapping(page_tags, slots, write_tags, 4).tolist() == [1, -1, 9, 14, -1]


def test_step_check_of_nothing_is_empty() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    args = (torch.ones(3, dtype=torch.int64), torch.empty(0, 0, dtype=torch.int32), empty.int(), empty, empty)
    inputs = StepCheckInputs(*args, torch.empty(0, 0, dtype=torch.int64), empty, empty, empty)
    is_bad, write_tags = check_step_triton(inputs, 4)
    assert is_bad.shape == (0,) and write_tags.shape == (0,)


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
def test_sampled_hash_triton_and_c_match_the_reference(
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
    assert page_hash_applies(pool_bytes, page_ids.int(), sample.offsets, sample.coeffs)
    native = sampled_page_hash_native(pool_bytes, page_ids.int(), sample.offsets, sample.coeffs)
    assert torch.equal(native, reference)
    first = pool_bytes[: num_layers - 1]  # the checked layers of a pool with an MTP layer after them: a view
    coeffs = sample.coeffs[: num_layers - 1]
    assert page_hash_applies(first, page_ids, sample.offsets, coeffs)
    expected = sampled_page_hash_reference(first, page_ids, sample.offsets, coeffs)
    assert torch.equal(sampled_page_hash_native(first, page_ids, sample.offsets, coeffs), expected)


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
    clean, _ = step_case(20, [6, 7], [1, 1], 4, seed=3)
    with pytest.raises(TypeError, match="int64"):
        check_step_reference(
            StepCheckInputs(**(clean | {"page_tags": clean["page_tags"].int()})), page_size=4
        )
    with pytest.raises(ValueError, match=r"expected_lens has shape \(3,\), expected \(2,\)"):
        check_step_reference(
            StepCheckInputs(**(clean | {"expected_lens": torch.zeros(3, dtype=torch.int64)})), page_size=4
        )
    pool_bytes, sample = hash_case(2, 3, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="coeffs has shape"):
        sampled_page_hash_reference(pool_bytes, torch.tensor([0]), sample.offsets, sample.coeffs[:1])
