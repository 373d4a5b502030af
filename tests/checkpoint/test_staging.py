"""Directories built under a temporary name appear complete or not at all."""

from __future__ import annotations

import pytest

from kvq.checkpoint.staging import staged_dir
from kvq.errors import KvqError


def test_complete_build_is_renamed_into_place(tmp_path):
    final = tmp_path / "out"
    with staged_dir(final) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not final.exists()
    assert (final / "a.txt").read_text() == "a"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_interrupted_build_leaves_nothing(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_dir(final) as tmp:
        (tmp / "half.bin").write_bytes(b"\0")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_empty_directory_is_filled_and_full_one_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with staged_dir(tmp_path / "empty") as tmp:
        (tmp / "x").write_text("x")
    assert (tmp_path / "empty" / "x").exists()
    with pytest.raises(KvqError, match="remove it or choose another path"), staged_dir(tmp_path / "empty"):
        pass
