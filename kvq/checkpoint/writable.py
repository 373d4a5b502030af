"""Can kvq write where it was told to? Asked before any work, by creating and removing a probe file.

A probe answers what permission bits cannot: a read-only filesystem, ACLs, root on a read-only mount.
`check_writable_dir` takes a directory that exists or will be created (its nearest existing parent is
probed); `check_writable_file` a file to be created or replaced (its directory is probed). Both raise
`KvqError` naming the path and what to do. Imports the standard library and kvq only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvq.checkpoint.write import TMP_SUFFIX
from kvq.errors import KvqError


def check_writable_dir(path: Path, what: str) -> None:
    """`path` exists as a directory kvq can create files in, or can be created as one."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():
            raise KvqError(f"{path}: {existing} is a broken symbolic link; choose another {what}")
        existing = existing.parent
    if not existing.is_dir():
        raise KvqError(
            f"{path}: {existing} is a file, not a directory; choose another {what}"
            if existing != path
            else f"{path}: exists and is not a directory; choose another {what}"
        )
    _probe(existing, path, what)


def check_writable_file(path: Path, flag: str) -> None:
    """`path` can be written (created or replaced) by `flag`'s writer, and its directory exists."""
    path = Path(path)
    if path.is_dir():
        raise KvqError(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'report.json'}")
    parent = path.parent
    if not parent.is_dir():
        raise KvqError(f"{flag} {path}: no such directory {parent}; create it or choose another path")
    _probe(parent, path, f"path for {flag}")


def _probe(directory: Path, asked: Path, what: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".kvq-probe-", suffix=TMP_SUFFIX, dir=directory)
    except OSError as e:
        reason = e.strerror or str(e)
        raise KvqError(
            f"{asked}: cannot write in {directory} ({reason}); choose a writable {what} or fix its "
            "permissions"
        ) from e
    os.close(fd)
    os.unlink(name)
