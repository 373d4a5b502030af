"""Load a list of documents from a .txt / .jsonl file or the bundled Wikipedia articles, and split them.

`load_texts(path, split)` is what calibration and evaluation read. The split is a pure function of each
document's text (sha256), so calibration and held-out evaluation never share a document, whatever the
source or its order. Imports only kvq.data and kvq.errors.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from kvq.data.wikipedia import DUMP_NAME, wikipedia_articles
from kvq.errors import KvqError

SPLITS = ("all", "calibration", "held_out")
HELD_OUT_ONE_IN = 10  # about one document in ten is held out
DEFAULT_SOURCE = f"gensim:{DUMP_NAME}"
_BLANK_LINES = re.compile(r"\n\s*\n")


def is_held_out(text: str) -> bool:
    """Whether a document belongs to the held-out split (a fixed function of its text)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_ONE_IN == 0


def load_texts(path: Path | None = None, split: str = "all") -> list[str]:
    """Documents from `path` (.txt: blank-line separated; .jsonl: a `text` field per line), or, with no
    path, the Wikipedia articles bundled in gensim; `split` keeps all, the calibration or the held-out ones.

    Raises `KvqError` naming the file for an unreadable, malformed or empty source.
    """
    if split not in SPLITS:
        raise KvqError(f"split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    texts = [text for _title, text in wikipedia_articles()] if path is None else read_documents(Path(path))
    if split != "all":
        texts = [t for t in texts if is_held_out(t) == (split == "held_out")]
    if not texts:
        where = source_name(path)
        raise KvqError(
            f"{where}: no {'' if split == 'all' else split + ' '}text found; "
            "give a file with at least one non-empty document"
        )
    return texts


def source_name(path: Path | None) -> str:
    """How a text source is named in messages and manifests."""
    return DEFAULT_SOURCE if path is None else str(path)


def read_documents(path: Path) -> list[str]:
    """The non-empty documents of a .txt or .jsonl file."""
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise KvqError(
            f"{path}: dataset files must be .txt (documents separated by blank lines) or .jsonl "
            f"(one JSON object with a 'text' field per line), found {suffix or 'no extension'}"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise KvqError(f"{path}: no such dataset file; check the path") from e
    except IsADirectoryError as e:
        raise KvqError(f"{path}: is a directory; pass a .txt or .jsonl file") from e
    except UnicodeDecodeError as e:
        raise KvqError(
            f"{path}: is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
        ) from e
    except OSError as e:
        raise KvqError(f"{path}: cannot read the dataset file ({e.strerror}); check permissions") from e
    documents = _jsonl_texts(path, raw) if suffix == ".jsonl" else _BLANK_LINES.split(raw)
    return [d.strip() for d in documents if d.strip()]


def _jsonl_texts(path: Path, raw: str) -> list[str]:
    texts: list[str] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise KvqError(
                f"{path}:{number}: not valid JSON ({e.msg}); each line must be one JSON object"
            ) from e
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise KvqError(
                f"{path}:{number}: expected a JSON object with a string 'text' field, "
                f"found {type(record).__name__}{' without text' if isinstance(record, dict) else ''}"
            )
        texts.append(record["text"])
    return texts
