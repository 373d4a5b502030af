"""cache_dir(): KVQ_CACHE_DIR, then XDG_CACHE_HOME/kvq, then ~/.cache/kvq."""

from __future__ import annotations

from pathlib import Path

from kvq.paths import cache_dir


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVQ_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "kvq"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == Path(tmp_path / "home" / ".cache" / "kvq")
