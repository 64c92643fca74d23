"""Full pages identified by a keyed, chained hash of (parent, tokens, identity).

The default page hash is BLAKE2b keyed with a per-manager random secret, over an injective byte
encoding, so nobody can construct a page whose hash collides with another prompt's page (and so
squat its chain). A hit is still verified token by token *and* against the exact parent entry (by a
unique node id), so even a replaced, weak hash function can never return another prompt's cache.
"""

import functools
import hashlib
import itertools
import secrets
import struct


def keyed_page_hash(key: bytes = None):
    """A page hash function ``(parent_hash, tokens, identity) -> bytes`` keyed with ``key`` (default: 32
    fresh random bytes). ``parent_hash`` is ``None`` or an earlier result; ``identity`` is bytes."""
    key = secrets.token_bytes(32) if key is None else bytes(key)
    if not 16 <= len(key) <= 64:
        raise ValueError(f"the page hash key must have 16..64 bytes, got {len(key)}")

    @functools.lru_cache(maxsize=1024)
    def keyed_identity(identity: bytes):
        # The state after the key and the identity: every page of a request starts from a copy of it.
        h = hashlib.blake2b(key=key, digest_size=32)
        h.update(len(identity).to_bytes(8, "little"))
        h.update(identity)
        return h

    @functools.lru_cache(maxsize=64)
    def packer(n: int) -> struct.Struct:
        return struct.Struct(f"<{n}q")

    def page_hash(parent_hash, tokens, identity: bytes) -> bytes:
        h = keyed_identity(identity).copy()
        h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash)  # digests have a fixed size
        h.update(packer(len(tokens)).pack(*tokens))
        return h.digest()

    return page_hash


class Entry:
    """A registered page: ``node`` is unique (never reused); ``parent_node`` is 0 for a first page."""

    __slots__ = ("page", "node", "parent_node", "tokens", "identity")

    def __init__(self, page: int, node: int, parent_node: int, tokens: tuple, identity: bytes):
        self.page, self.node, self.parent_node, self.tokens, self.identity = page, node, parent_node, tokens, identity

    def holds(self, parent_node: int, tokens: tuple, identity: bytes) -> bool:
        """True iff this entry is exactly the page of ``tokens`` after ``parent_node`` for ``identity``."""
        return self.parent_node == parent_node and self.tokens == tokens and self.identity == identity


class PrefixIndex:
    """hash -> registered page. ``hash_fn(parent_hash, tokens, identity)`` is replaceable (tests use weak
    ones); the default is :func:`keyed_page_hash` with a fresh key."""

    ROOT = 0

    def __init__(self, hash_fn=None):
        self.hash_fn = hash_fn if hash_fn is not None else keyed_page_hash()
        self.by_hash = {}
        self.by_page = {}
        self.nodes = {self.ROOT}  # the nodes of registered entries, and the root: a chain can only go on from these
        self._nodes = itertools.count(1)

    def lookup(self, parent_hash, parent_node: int, tokens: tuple, identity: bytes):
        """(hash, entry or None) for the page holding ``tokens`` right after ``parent_node``."""
        h = self.hash_fn(parent_hash, tokens, identity)
        entry = self.by_hash.get(h)
        return h, (entry if entry is not None and entry.holds(parent_node, tokens, identity) else None)

    def register(self, h, page: int, parent_node: int, tokens: tuple, identity: bytes):
        """The entry for this page content: a new one holding ``page``, or the entry that already holds
        the same content (another request computed the same prefix: ``page`` then stays private, and the
        caller's chain goes on through that entry). None only when ``h`` is taken by *other* content (a
        collision of a weak hash function)."""
        entry = self.by_hash.get(h)
        if entry is not None:
            return entry if entry.holds(parent_node, tokens, identity) else None
        if page in self.by_page:
            raise AssertionError(f"page {page} is registered twice")
        entry = Entry(page, next(self._nodes), parent_node, tokens, identity)
        self.by_hash[h] = entry
        self.by_page[page] = h
        self.nodes.add(entry.node)
        return entry

    def unreachable_page(self, h, parent_node: int, tokens: tuple, identity: bytes):
        """The page of the entry under ``h`` if it holds ``tokens`` for ``identity`` after a parent that is no longer
        registered (evicted while this page lived on), else None. No lookup can reach such an entry (a lookup walks
        registered nodes from the root, and nodes are never reused), yet it holds the hash the same content has after
        the parent's re-registration: left in place, it would keep that content from ever being published again."""
        entry = self.by_hash.get(h)
        if entry is None or entry.parent_node in self.nodes or entry.parent_node == parent_node:
            return None
        return entry.page if entry.tokens == tokens and entry.identity == identity else None

    def remove_page(self, page: int) -> None:
        """Forgets the page (it was evicted); no-op for a page that is not registered."""
        h = self.by_page.pop(page, None)
        if h is not None:
            self.nodes.discard(self.by_hash.pop(h).node)

    def clear(self) -> None:
        """Forgets every page."""
        self.by_hash.clear()
        self.by_page.clear()
        self.nodes = {self.ROOT}

    def is_cached(self, page: int) -> bool:
        return page in self.by_page
