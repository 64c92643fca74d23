"""The per-request state a step is built from, one row per live request in arrays that persist across
steps, so a step reads and updates a whole batch with a few numpy operations instead of a Python loop.

Row ``i`` of a live request:

* ``computed[i]``: positions ``[0, computed)`` are stored in the cache;
* ``first_page[i]``: page index of the first retained page (pages before it were released);
* ``npages[i]``: retained pages; ``table[i, :npages]`` holds their first slots (``page * page_size``)
  in position order, ``table[i, npages:]`` is ``-1`` — exactly a row of the op's ``cachestarts``;
* ``known_end[i]``: the request's token list holds the ids of positions ``[token_base, known_end)``;
* ``tail[i, p % page_size]``: the id of position ``p`` for ``known_end <= p < computed`` (tokens a
  decode step fed beyond the list; never more than one page of them, see the manager).
"""

import numpy as np


class RequestRows:
    """Rows for up to ``capacity`` requests (grows by doubling); page tables ``max_pages`` wide. The four
    scalars of a row are the columns of one ``state`` array, so a batch reads them in one gather."""

    COMPUTED, FIRST_PAGE, NPAGES, KNOWN_END = range(4)

    def __init__(self, max_pages: int, page_size: int, capacity: int = 64):
        self.max_pages, self.page_size = max_pages, page_size
        self.state = np.zeros((capacity, 4), np.int64)
        self.table = np.full((capacity, max_pages), -1, np.int64)
        self.tail = np.zeros((capacity, page_size), np.int64)
        self._free = list(range(capacity - 1, -1, -1))  # a stack: the lowest free row is reused first

    computed = property(lambda self: self.state[:, RequestRows.COMPUTED])
    first_page = property(lambda self: self.state[:, RequestRows.FIRST_PAGE])
    npages = property(lambda self: self.state[:, RequestRows.NPAGES])
    known_end = property(lambda self: self.state[:, RequestRows.KNOWN_END])

    def allocate(self) -> int:
        """A row in its empty state (nothing computed, no pages)."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def free(self, row: int) -> None:
        """Returns ``row`` to its empty state and to the free rows."""
        self.state[row] = 0
        self.table[row] = -1
        self._free.append(row)

    def pages(self, row: int) -> list:
        """Page ids of the row's retained pages, in position order."""
        return (self.table[row, :self.state[row, self.NPAGES]] // self.page_size).tolist()

    def set_pages(self, row: int, pages: list) -> None:
        """Replaces the row's retained pages (``len(pages) <= max_pages``)."""
        n = len(pages)
        self.table[row, :n] = np.asarray(pages, np.int64) * self.page_size
        self.table[row, n:] = -1
        self.state[row, self.NPAGES] = n

    def live_rows(self) -> np.ndarray:
        """Rows that are allocated (tests)."""
        live = np.ones(len(self.state), bool)
        live[self._free] = False
        return np.flatnonzero(live)

    def _grow(self) -> None:
        old = len(self.state)
        self.state = np.concatenate([self.state, np.zeros((old, 4), np.int64)])
        self.table = np.concatenate([self.table, np.full((old, self.max_pages), -1, np.int64)])
        self.tail = np.concatenate([self.tail, np.zeros((old, self.page_size), np.int64)])
        self._free.extend(range(2 * old - 1, old - 1, -1))
