"""Replace several files of a directory as one unit: all of them land, or none does.

`commit_files(root, writers)` stages every new file as `NAME.kvq-tmp`, records the unit in a journal
(`.kvq-commit.json.kvq-tmp`: the names, and which of them existed), keeps each existing file as a hard
link `NAME.kvq-orig.kvq-tmp`, renames the staged files over the final names in the order given (put the
file that marks the unit done, a manifest, last), then removes the journal and the kept originals.
An exception on the way (a full disk, a name that cannot be replaced, Ctrl-C) puts every original back
and removes every new file before it propagates; a process killed half way leaves the journal, and
`recover(root, names)`, which the next writer of those names runs first, rolls back from it. Either way
the directory ends byte-identical to before. Temporary names all end in `.kvq-tmp`, which kvq's readers
and `kvq push` refuse or skip. Imports the standard library, kvq.checkpoint.write and kvq.errors.

Fault injection for tests: `KVQ_WRITE_FAULT=N` makes the N-th file operation of a commit (1-based,
counting each staged write, the journal, each kept original and each rename) raise `OSError`;
`KVQ_WRITE_FAULT=N:kill` sends the process SIGKILL there instead.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

from kvq.checkpoint.write import TMP_SUFFIX, write_json_atomic
from kvq.errors import KvqError

JOURNAL_NAME = ".kvq-commit.json" + TMP_SUFFIX
FAULT_ENV = "KVQ_WRITE_FAULT"
Writer = Callable[[Path], None]  # writes a whole file at the path it is given


def staged_path(final: Path) -> Path:
    return final.with_name(final.name + TMP_SUFFIX)


def original_path(final: Path) -> Path:
    return final.with_name(final.name + ".kvq-orig" + TMP_SUFFIX)


class _FaultPoint:
    """Counts file operations and fails the one `KVQ_WRITE_FAULT` names (tests only; unset: no effect)."""

    def __init__(self) -> None:
        spec = os.environ.get(FAULT_ENV, "")
        at, _, kind = spec.partition(":")
        self.at = int(at) if at.isdigit() else 0
        self.kind = kind
        self.count = 0

    def __call__(self, what: str) -> None:
        self.count += 1
        if self.count != self.at:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.EIO, f"injected fault ({FAULT_ENV}={self.at}) at {what}")


def commit_files(root: Path, writers: Sequence[tuple[str, Writer]]) -> None:
    """Write each `(name, writer)` of `root` as one unit, in order; on failure `KvqError`, nothing changed."""
    root = Path(root)
    names = [name for name, _ in writers]
    recover(root, names)
    fault = _FaultPoint()
    originals = [name for name in names if (root / name).exists()]
    renamed: list[str] = []
    doing = ""
    try:
        for name, write in writers:
            fault(doing := f"writing {name}")
            write(staged_path(root / name))
        fault(doing := "writing the journal")
        write_json_atomic({"files": names, "originals": originals}, root / JOURNAL_NAME)
        for name in originals:
            fault(doing := f"keeping {name}")
            _keep(root / name)
        for name in names:
            fault(doing := f"replacing {name}")
            os.replace(staged_path(root / name), root / name)
            renamed.append(name)
    except BaseException as e:
        _roll_back(root, names, originals, renamed)
        if isinstance(e, OSError):
            raise KvqError(
                f"{root}: failed {doing} ({e.strerror or e}); nothing was changed: fix the cause "
                "(permissions, free space) and re-run"
            ) from e
        raise
    (root / JOURNAL_NAME).unlink()  # the unit is done: from here a kill changes nothing
    _remove_temporaries(root, names)


def recover(root: Path, names: Sequence[str]) -> None:
    """Undo the unit a killed `commit_files` left half-done (its journal says which), and remove the
    temporary files of `names` an interrupted one left."""
    root = Path(root)
    journal = root / JOURNAL_NAME
    if journal.exists():
        try:
            record = json.loads(journal.read_text())
            files, originals = list(record["files"]), list(record["originals"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KvqError(
                f"{journal}: the record of an interrupted kvq write is unreadable ({e}); restore the "
                "checkpoint from its source"
            ) from e
        _roll_back(root, files, originals, files)
        names = [*names, *files]
    _remove_temporaries(root, names)


def _keep(final: Path) -> None:
    kept = original_path(final)
    kept.unlink(missing_ok=True)
    try:
        os.link(final, kept)
    except OSError:  # a filesystem without hard links: a copy serves the same purpose
        shutil.copy2(final, kept)


def _roll_back(root: Path, names: Sequence[str], originals: Sequence[str], renamed: Sequence[str]) -> None:
    for name in renamed:
        kept = original_path(root / name)
        if kept.exists():
            os.replace(kept, root / name)
        elif name not in originals:
            (root / name).unlink(missing_ok=True)
    (root / JOURNAL_NAME).unlink(missing_ok=True)
    _remove_temporaries(root, names)


def _remove_temporaries(root: Path, names: Sequence[str]) -> None:
    for name in names:
        for path in (staged_path(root / name), original_path(root / name)):
            path.unlink(missing_ok=True)
        for leftover in root.glob(f"{name}{TMP_SUFFIX}{TMP_SUFFIX}"):  # a staged write's own temporary
            leftover.unlink()
