"""Full pages identified by a chained hash of (parent, tokens, extra keys).

A hit is verified token by token *and* against the exact parent entry (by a unique node id), so
neither a hash collision nor a parent that was evicted and re-inserted with other content can ever
return another prompt's cache.
"""

import itertools


def chained_hash(parent_hash, tokens: tuple, extra) -> int:
    """Default block hash: Python's tuple hash of (parent hash, tokens, extra); stable within a process."""
    return hash((parent_hash, tokens, extra))


class Entry:
    """A registered page: ``node`` is unique (never reused); ``parent_node`` is 0 for a first page."""

    __slots__ = ("page", "node", "parent_node", "tokens", "extra")

    def __init__(self, page: int, node: int, parent_node: int, tokens: tuple, extra):
        self.page, self.node, self.parent_node, self.tokens, self.extra = page, node, parent_node, tokens, extra


class PrefixIndex:
    """hash -> cached page. ``hash_fn(parent_hash, tokens, extra)`` is replaceable (tests use a weak one)."""

    ROOT = 0

    def __init__(self, hash_fn=chained_hash):
        self.hash_fn = hash_fn
        self.by_hash = {}
        self.by_page = {}
        self._nodes = itertools.count(1)

    def lookup(self, parent_hash, parent_node: int, tokens: tuple, extra):
        """(hash, entry or None) for the page holding ``tokens`` right after ``parent_node``."""
        h = self.hash_fn(parent_hash, tokens, extra)
        entry = self.by_hash.get(h)
        if entry is not None and entry.parent_node == parent_node and entry.tokens == tokens and entry.extra == extra:
            return h, entry
        return h, None

    def insert(self, h, page: int, parent_node: int, tokens: tuple, extra):
        """Registers a full page under hash ``h``; returns its Entry, or None when ``h`` is taken (a
        collision or the same prefix computed twice): the page then stays private to its sequence."""
        if h in self.by_hash or page in self.by_page:
            return None
        entry = Entry(page, next(self._nodes), parent_node, tokens, extra)
        self.by_hash[h] = entry
        self.by_page[page] = h
        return entry

    def remove_page(self, page: int) -> None:
        h = self.by_page.pop(page, None)
        if h is not None:
            del self.by_hash[h]

    def is_cached(self, page: int) -> bool:
        return page in self.by_page
