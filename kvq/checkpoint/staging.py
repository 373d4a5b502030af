"""Build a directory under a temporary name next to its final place and rename it in when complete.

An interrupted build leaves only a `.<name>.kvq-tmp-<pid>` folder (removed on the next try), never a
half-written directory under the final name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvq.errors import KvqError


def staging_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.kvq-tmp-{os.getpid()}")


@contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success rename it to `final` (which may be an empty dir)."""
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise KvqError(
            f"{final}: already exists and is not an empty directory; remove it or choose another path"
        )
    tmp = staging_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if final.exists():
            final.rmdir()
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
