"""Page tags: fill tags never collide (over owners, logical pages and generations) and are never the
free tag; sealed tags are the chain hash as a signed int64; formatting shows the unsigned pattern."""

from __future__ import annotations

import itertools

from kvq.runtime.integrity.tags import FREE_TAG, fill_tag, format_tag, sealed_tag, to_int64

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def test_fill_tags_are_distinct_and_never_free() -> None:
    grid = list(itertools.product(range(40), range(25), range(30)))  # seq id, logical page, generation
    tags = [fill_tag(s, i, g) for s, i, g in grid]
    assert len(set(tags)) == len(grid)
    assert FREE_TAG not in tags
    assert all(INT64_MIN <= t <= INT64_MAX for t in tags)
    # swapping the fields is another tag (each field is mixed in at its own place)
    assert fill_tag(1, 2, 3) != fill_tag(2, 1, 3) != fill_tag(3, 2, 1)


def test_fill_tags_depend_on_every_field() -> None:
    base = fill_tag(7, 3, 1_000_000)
    assert base == fill_tag(7, 3, 1_000_000)
    assert len({base, fill_tag(8, 3, 1_000_000), fill_tag(7, 4, 1_000_000), fill_tag(7, 3, 1_000_001)}) == 4


def test_sealed_tags_are_the_chain_hash_as_int64() -> None:
    assert sealed_tag(5) == 5
    assert sealed_tag((1 << 64) - 1) == -1  # the top bit set: negative as int64
    assert sealed_tag(1 << 63) == INT64_MIN
    assert sealed_tag(0) == 1 != FREE_TAG  # the one hash that would read as "free"


def test_to_int64_and_format_round_trip() -> None:
    for value in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 0x9E3779B97F4A7C15):
        signed = to_int64(value)
        assert INT64_MIN <= signed <= INT64_MAX
        assert format_tag(signed) == f"0x{value:016x}"
    assert format_tag(-1) == "0xffffffffffffffff"
    assert format_tag(None) == "no page"
