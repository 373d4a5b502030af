"""User-facing errors: one exception type the CLI turns into one line and exit code 2.

Raise `KvqError` for anything the user can fix (bad path, bad file, bad flag); its message names the
file or tensor, what was expected, what was found and the fix. Internal invariants use `assert`.
"""

from __future__ import annotations


class KvqError(Exception):
    """An error caused by the user's input; printed as one line by the CLI (exit code 2)."""

    exit_code = 2
