"""Pages of one cache tensor: reference counts, a free list, and an LRU of cached unreferenced pages.

A page is in exactly one state: referenced (ref count > 0), cached (ref count 0, registered in the
prefix index, evictable, in LRU order), or free (ref count 0, not cached). ``take`` hands out free
pages first, so releasing unhashed pages never flushes cached prefixes, then evicts the least recently
used cached page. Every operation is O(1).
"""

import collections

from .identity import check_int


class PagePool:
    """Page ids 0..num_pages-1. ``on_evict(page)`` is called when a cached page is evicted.

    A page id that is not an integer in ``[0, num_pages)`` is a ``TypeError``/``ValueError`` with nothing
    changed (a negative id would otherwise index another page from the end)."""

    def __init__(self, num_pages: int, on_evict=None):
        num_pages = check_int("num_pages", num_pages)
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.ref_count = [0] * num_pages
        self.free = collections.deque(range(num_pages))
        self.cached = collections.OrderedDict()  # page -> None, least recently used first
        self.on_evict = on_evict
        self.evictions = 0

    def available(self) -> int:
        """Pages ``take`` can hand out without failing."""
        return len(self.free) + len(self.cached)

    def take(self) -> int:
        """A page with ref count 1: a free one, else the LRU cached one (evicted). Raises IndexError if none."""
        if self.free:
            page = self.free.popleft()
        elif self.cached:
            page, _ = self.cached.popitem(last=False)
            self.evictions += 1
            if self.on_evict:
                self.on_evict(page)
        else:
            raise IndexError("no free or evictable page")
        self.ref_count[page] = 1
        return page

    def take_many(self, n: int) -> list:
        """``n`` pages, exactly as ``n`` calls of ``take`` would hand them out, in that order (the free
        ones without a call each). Raises IndexError, having taken nothing, if fewer are available."""
        n = check_int("the page count", n)
        if n < 0:
            raise ValueError(f"the page count must be >= 0, got {n}")
        if n > self.available():
            raise IndexError(f"{n} pages asked for, {self.available()} free or evictable")
        free, ref_count = self.free, self.ref_count
        pages = [free.popleft() for _ in range(min(n, len(free)))]
        for page in pages:
            ref_count[page] = 1
        while len(pages) < n:
            pages.append(self.take())
        return pages

    def acquire(self, page: int) -> None:
        """One more reference to a page (a cached page leaves the LRU)."""
        page = self._page(page)
        if self.ref_count[page] == 0:
            if page not in self.cached:
                raise ValueError(f"page {page} is free; only referenced or cached pages can be shared")
            del self.cached[page]
        self.ref_count[page] += 1

    def release(self, page: int, cached: bool) -> None:
        """Drops one reference; at zero the page becomes cached (most recently used) or free."""
        page = self._page(page)
        if self.ref_count[page] <= 0:
            raise ValueError(f"page {page} released more often than acquired")
        self.ref_count[page] -= 1
        if self.ref_count[page] == 0:
            if cached:
                self.cached[page] = None
            else:
                self.free.append(page)

    def untake(self, page: int) -> None:
        """Undoes ``take``: the page (ref count 1, never registered) goes back to the front of the free
        list, where ``take`` found it (an evicted page is not re-cached: it may have been written)."""
        page = self._page(page)
        if self.ref_count[page] != 1:
            raise ValueError(f"page {page} has ref count {self.ref_count[page]}; only a page just taken can go back")
        self.ref_count[page] = 0
        self.free.appendleft(page)

    def reclaim(self, page: int) -> None:
        """One more reference to a page, wherever it is: referenced, cached or free (used to roll a step
        back: a page the step released gets its reference back). O(free pages) for a free page."""
        page = self._page(page)
        if self.ref_count[page] == 0:
            if page in self.cached:
                del self.cached[page]
            else:
                self.free.remove(page)
        self.ref_count[page] += 1

    def forget_cached(self, page: int) -> None:
        """A cached page becomes free (its prefix entry was removed); a referenced page is left as it is."""
        page = self._page(page)
        if self.ref_count[page] == 0 and page in self.cached:
            del self.cached[page]
            self.free.append(page)

    def _page(self, page) -> int:
        """``page`` as a Python int if it is an id of this pool; else ``TypeError``/``ValueError``."""
        if type(page) is not int:  # the manager's own ids are Python ints: one type test on its path
            page = check_int("page", page)
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is not in this pool of {self.num_pages} pages")
        return page

    def drop_cached(self) -> None:
        """Every cached page becomes free (the prefix index was cleared)."""
        self.free.extend(self.cached)
        self.cached.clear()

    def counts(self) -> dict:
        in_use = sum(1 for c in self.ref_count if c > 0)
        return {"pages_free": len(self.free), "pages_cached": len(self.cached), "pages_in_use": in_use}

    def check(self) -> None:
        """Asserts the invariants (tests): every page in exactly one state."""
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a page is twice in the free list"
        assert not free & cached, "a page is both free and cached"
        for page, count in enumerate(self.ref_count):
            assert count >= 0
            states = (count > 0) + (page in free) + (page in cached)
            assert states == 1, f"page {page}: ref count {count}, free {page in free}, cached {page in cached}"
