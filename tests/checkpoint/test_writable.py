"""Where kvq may write, asked before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvq.checkpoint.writable import check_writable_dir, check_writable_file
from kvq.errors import KvqError


def test_a_new_directory_under_a_writable_parent_passes_and_nothing_is_left(tmp_path: Path) -> None:
    check_writable_dir(tmp_path / "a" / "b" / "out", "OUT directory")
    check_writable_file(tmp_path / "report.json", "--json")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda t: (t / "f").write_text("") or t / "f" / "out", "is a file, not a directory"),
        (lambda t: (t / "f").write_text("") or t / "f", "exists and is not a directory"),
        (lambda t: (t / "link").symlink_to(t / "nowhere") or t / "link" / "out", "broken symbolic link"),
    ],
    ids=["parent is a file", "OUT is a file", "broken link"],
)
def test_a_directory_kvq_cannot_make_is_named(tmp_path: Path, make, fragment: str) -> None:
    with pytest.raises(KvqError, match=fragment):
        check_writable_dir(make(tmp_path), "OUT directory")


def test_a_read_only_place_is_named(monkeypatch, tmp_path: Path) -> None:
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("kvq.checkpoint.writable.tempfile.mkstemp", read_only)
    with pytest.raises(
        KvqError, match=r"cannot write in .* \(Read-only file system\); choose a writable OUT"
    ):
        check_writable_dir(tmp_path / "out", "OUT directory")
    with pytest.raises(KvqError, match=r"--json .*r.json: cannot write in|r.json: cannot write in"):
        check_writable_file(tmp_path / "r.json", "--json")
