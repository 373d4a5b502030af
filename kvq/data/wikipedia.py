"""Real English Wikipedia articles shipped inside the `gensim` wheel (a 2017 dump excerpt, ~100 articles).

`gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2` holds wiki
markup; gensim's own `extract_pages` + `filter_wiki` turn it into plain text. Redirect pages and stubs are
dropped. Imports gensim lazily (it pulls in scipy); from kvq only kvq.data.packages and kvq.errors.
"""

from __future__ import annotations

import bz2
import functools
import re
from pathlib import Path

from kvq.data.packages import package_dir
from kvq.errors import KvqError

DUMP_NAME = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_ARTICLE_CHARS = 2000  # shorter pages are redirects, disambiguations and stubs
_EMPHASIS = re.compile(r"'{2,}")  # wiki ''italic'' / '''bold''' quotes left by filter_wiki


def dump_path() -> Path:
    """The bz2 Wikipedia dump inside the installed gensim package (found without importing gensim)."""
    root = package_dir("gensim", "gensim", "the default text (Wikipedia articles)", "pass --dataset FILE")
    path = root / "test" / "test_data" / DUMP_NAME
    if not path.is_file():
        raise KvqError(f"{path}: missing from the gensim install; reinstall gensim or pass --dataset FILE")
    return path


@functools.lru_cache(maxsize=1)
def wikipedia_articles() -> tuple[tuple[str, str], ...]:
    """(title, plain text) of every real article in the dump, in dump order (parsed once per process)."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = dump_path()
    articles: list[tuple[str, str]] = []
    try:
        with bz2.open(path) as f:
            for title, markup, _page_id in extract_pages(f):
                text = _EMPHASIS.sub("", filter_wiki(markup)).strip()
                if len(text) >= MIN_ARTICLE_CHARS and not text.upper().startswith("#REDIRECT"):
                    articles.append((title, text))
    except (OSError, EOFError) as e:
        raise KvqError(f"{path}: cannot read the Wikipedia dump ({e}); reinstall gensim") from e
    return tuple(articles)
