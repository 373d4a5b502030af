"""The one byte-size convention of every flag: GB = G = 10^9, GiB = Gi = 2^30, a bare number is bytes."""

from __future__ import annotations

import pytest

from kvq.byte_sizes import format_bytes, parse_bytes
from kvq.errors import KvqError


def test_decimal_units_are_powers_of_1000() -> None:
    assert parse_bytes("80GB", "--gpu-mem") == 80 * 10**9
    assert parse_bytes("24GB", "--kv-memory") == 24 * 10**9
    assert parse_bytes("2G", "--kv-memory") == 2 * 10**9
    assert parse_bytes("512 kb", "x") == 512_000
    assert parse_bytes("1.5TB", "x") == int(1.5 * 10**12)


def test_binary_units_are_powers_of_1024() -> None:
    assert parse_bytes("141GiB", "--gpu-mem") == 141 * 2**30
    assert parse_bytes("512MiB", "x") == 512 * 1024**2
    assert parse_bytes("1.5Gi", "x") == int(1.5 * 1024**3)
    assert parse_bytes("1.5 TiB", "x") == int(1.5 * 2**40)
    assert parse_bytes("4ki", "x") == 4096


def test_bare_numbers_are_bytes() -> None:
    assert parse_bytes("4096", "x") == 4096
    assert parse_bytes("4096B", "x") == 4096
    assert parse_bytes(100, "x") == 100
    assert parse_bytes("2.5", "x") == 2


@pytest.mark.parametrize("bad", ["lots", "-1G", "0", "0.0GiB", "12 GBs", "1.2.3G", "G", "", "5XB"])
def test_anything_else_is_a_user_error_naming_the_flag(bad: str) -> None:
    with pytest.raises(KvqError, match="^--kv-memory: "):
        parse_bytes(bad, "--kv-memory")


def test_format_bytes_uses_binary_units() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 2**30, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.50 KiB",
        "1.00 GiB",
        "5.00 TiB",
    ]
