"""Several files replaced as one unit: all land, or the directory is byte-identical to before."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.checkpoint.file_commit import JOURNAL_NAME, commit_files, recover
from kvq.errors import KvqError


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _writer(data: bytes):
    return lambda path: path.write_bytes(data)


def test_all_files_land_in_order(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b"old a")
    commit_files(tmp_path, [("new.bin", _writer(b"new")), ("a.json", _writer(b"new a"))])
    assert files(tmp_path) == {"new.bin": b"new", "a.json": b"new a"}


def test_a_name_that_cannot_be_replaced_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b"old a")
    (tmp_path / "config.json").mkdir()  # a directory in the way: the rename fails, as on a read-only name
    (tmp_path / "config.json" / "keep").write_bytes(b"x")
    before = files(tmp_path)
    writers = [("new.bin", _writer(b"new")), ("a.json", _writer(b"new a")), ("config.json", _writer(b"{}"))]
    with pytest.raises(
        KvqError, match=f"{tmp_path}: failed (keeping|replacing) config.json .*nothing was changed"
    ):
        commit_files(tmp_path, writers)
    assert files(tmp_path) == before


def test_an_interrupt_while_staging_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_bytes(b"old a")

    def interrupted(path: Path) -> None:
        path.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        commit_files(tmp_path, [("a.json", _writer(b"new a")), ("b.json", interrupted)])
    assert files(tmp_path) == {"a.json": b"old a"}


def test_recover_rolls_back_what_a_kill_left(tmp_path: Path) -> None:
    """The state a kill between two renames leaves: first file replaced (original kept), journal there."""
    (tmp_path / "a.json").write_bytes(b"new a")
    (tmp_path / "a.json.kvq-orig.kvq-tmp").write_bytes(b"old a")
    (tmp_path / "new.bin").write_bytes(b"new")
    (tmp_path / "b.json.kvq-tmp").write_bytes(b"staged b")
    (tmp_path / "b.json").write_bytes(b"old b")
    (tmp_path / "b.json.kvq-orig.kvq-tmp").write_bytes(b"old b")
    (tmp_path / JOURNAL_NAME).write_text(
        '{"files": ["new.bin", "a.json", "b.json"], "originals": ["a.json", "b.json"]}'
    )
    recover(tmp_path, ["new.bin", "a.json", "b.json"])
    assert files(tmp_path) == {"a.json": b"old a", "b.json": b"old b"}


def test_an_unreadable_journal_is_named(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_NAME).write_text("{")
    with pytest.raises(KvqError, match="record of an interrupted kvq write is unreadable"):
        recover(tmp_path, ["a.json"])
