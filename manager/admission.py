"""Admitting and finishing requests: part of :class:`~.kv_manager.KVCacheManager`.

Admission matches a prompt's full pages against the prefix index (never its last token: a step must compute
one to produce logits) and holds the hit pages; finishing releases them, last page first.
"""

from .identity import page_identity, token_ids
from .step_records import Request


class Admission:
    """The manager's admission (uses its ``rows``, ``pool``, ``index``, ``requests`` and configuration)."""

    def add_request(self, rid, prompt, salt=None) -> int:
        """Admits a request; returns how many prompt tokens come from the prefix cache (full pages only,
        and never the last prompt token: a step must compute at least one token to produce logits).
        ``TypeError``/``ValueError`` (nothing changed) for a bad prompt or salt."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already active")
        prompt = token_ids(prompt, self.vocab_size, f"request {rid!r}: prompt")
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if not self.window_bounds and self.streaming is None and -(-len(prompt) // self.page_size) > self.max_pages:
            why = "" if self.sliding_window is None else \
                f" (the sliding window of {self.sliding_window} tokens spans more than those pages: it frees none " \
                "before the prompt needs more)"
            raise ValueError(f"request {rid!r}: a prompt of {len(prompt)} tokens needs more than "
                             f"max_pages={self.max_pages} pages of {self.page_size}{why}")
        r = Request(rid, -1, page_identity(salt, self.cache_key), prompt)
        reusable = (len(prompt) - 1) // self.page_size
        if self.streaming is not None:
            reusable = min(reusable, self.sink_pages)  # later pages get shifted or dropped in place
        hits = []
        for j in range(reusable):
            tokens = tuple(prompt[j * self.page_size:(j + 1) * self.page_size])
            h, entry = self.index.lookup(r.chain_tail[0], r.chain_tail[1], tokens, r.identity)
            if entry is None:
                break
            hits.append(entry.page)
            r.chain_tail = (h, entry.node)
        r.registered = len(hits)
        computed = len(hits) * self.page_size
        first = 0
        if self.sliding_window is not None:  # hit pages wholly before the first query's window are not held
            first = max(0, computed - self.sliding_window + 1) // self.page_size
        pages = hits[first:]
        if len(pages) > self.max_pages:  # a guard: a window wider than max_pages pages is refused above
            raise ValueError(f"request {rid!r}: the sliding window needs {len(pages)} pages of its cached prefix, "
                             f"more than max_pages={self.max_pages}")
        r.row = row = self.rows.allocate()
        self.rows.computed[row], self.rows.first_page[row], self.rows.known_end[row] = computed, first, len(prompt)
        self.rows.set_pages(row, pages)
        for page in pages:
            self.pool.acquire(page)
        self.queried_tokens += len(prompt)
        self.hit_tokens += computed
        self.requests[rid] = r
        self._row_of[rid] = row
        return computed

    def finish(self, rid) -> None:
        """Releases a request's pages (registered ones stay cached for reuse until evicted), last page
        first: under LRU eviction a cached chain then loses its end before its root, so a conversation
        that comes back keeps its longest prefix."""
        r = self._get(rid)
        if self._pending is not None and bool((self._pending.rows == r.row).any()):
            raise RuntimeError(f"request {rid!r} is in the outstanding step: commit(plan) or abort(plan) first")
        for page in reversed(self.rows.pages(r.row)):
            self.pool.release(page, cached=self.index.is_cached(page))
        self.rows.free(r.row)
        del self.requests[rid], self._row_of[rid]
        self._last_batch = None
