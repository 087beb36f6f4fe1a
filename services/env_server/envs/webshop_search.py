"""WebShop's search (see webshop.py): BM25 full-text search over the catalogue, SQLite FTS5 in memory."""

from __future__ import annotations

import sqlite3
import threading
from typing import Sequence

from .webshop_catalog import STOPWORDS, Product, words

SEARCH_RETURN_N = 50
MAX_QUERY_TERMS = 32


def _document(product: Product) -> str:
    options = ", and ".join(f"{name}: {', '.join(values)}" for name, values in product.options)
    return " ".join([product.title, product.description, " ".join(product.bullets), options]).lower()


def fts_query(text: str) -> str:
    """Free text as an FTS5 query: its words, each quoted, OR-ed (BM25 ranks by how many and how rare)."""
    terms = list(dict.fromkeys(w for w in words(text) if w not in STOPWORDS))[:MAX_QUERY_TERMS]
    return " OR ".join('"' + t.replace('"', "") + '"' for t in terms)


class SearchIndex:
    """BM25 full-text search over the catalogue: SQLite FTS5 in memory, shared by all episodes."""

    CACHE_SIZE = 8192

    def __init__(self, products: Sequence[Product]):
        self._products = list(products)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        try:
            self._db.execute("CREATE VIRTUAL TABLE docs USING fts5(contents, tokenize = 'porter unicode61')")
        except sqlite3.OperationalError as exc:
            raise RuntimeError(f"this Python's sqlite3 has no FTS5 ({exc}); WebShop needs it for search") from exc
        self._db.executemany("INSERT INTO docs(rowid, contents) VALUES (?, ?)",
                             ((i, _document(p)) for i, p in enumerate(self._products)))
        self._cache: dict[str, tuple[Product, ...]] = {}

    def search(self, text: str, k: int = SEARCH_RETURN_N) -> tuple[Product, ...]:
        """The top k products for free text, best first (ties by catalogue order)."""
        query = fts_query(text)
        if not query:
            return ()
        key = f"{k}\x00{query}"
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                rows = self._db.execute(
                    "SELECT rowid FROM docs WHERE docs MATCH ? ORDER BY bm25(docs), rowid LIMIT ?", (query, k))
                hit = tuple(self._products[r] for (r,) in rows)
                if len(self._cache) >= self.CACHE_SIZE:
                    self._cache.clear()
                self._cache[key] = hit
        return hit

