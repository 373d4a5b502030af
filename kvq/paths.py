"""Where kvq keeps files it builds once and reuses (the embedded SmolLM2 checkpoints, say).

One function, `cache_dir()`, is the single source of that location; it imports nothing from kvq.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$KVQ_CACHE_DIR` if set, else `$XDG_CACHE_HOME/kvq`, else `~/.cache/kvq` (not created here)."""
    explicit = os.environ.get("KVQ_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvq"
