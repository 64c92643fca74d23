"""Publishing a committed step's full pages for prefix reuse: part of :class:`~.kv_manager.KVCacheManager`.

A page joins the prefix index only once the step that wrote it is committed, as the next page of its
request's hash chain; under StreamingLLM only sink pages are ever shared. The token history a request keeps
is trimmed here too, to what later steps need.
"""

import numpy as np

from .step_records import OutstandingStep, Request


class PrefixPublisher:
    """The manager's publishing steps (uses its ``rows``, ``index``, ``requests``, ``page_size`` and
    ``streaming``)."""

    def _publish(self, step: OutstandingStep) -> None:
        """Publishes the full pages of a step that ran (``commit``) and drops history no later step needs."""
        R, ps = self.rows, self.page_size
        # A plain append has something to publish only when it filled a page (decode steps planned at once: one of
        # them did).
        filled = step.end // ps > step.before[:, 0] // ps
        touched = np.flatnonzero(filled if step.plain is None else filled | ~step.plain)
        if not len(touched):
            return
        rows, end = step.rows[touched], step.end[touched]
        # A page filled by plain appends alone is in the tail buffer: it is published from there, and
        # the request's token list then holds nothing a later step needs (streaming keeps its history).
        quick = filled[touched] & (R.known_end[rows] <= end - ps)
        if step.plain is not None:
            quick &= step.plain[touched]
        if self.streaming is not None:
            quick[:] = False
        quick_rows, quick_end = rows[quick], end[quick]
        filled_pages = iter(zip(R.tail[quick_rows].tolist(),
                                (R.table[quick_rows, quick_end // ps - 1 - R.first_page[quick_rows]] // ps).tolist()))
        for b, is_quick, end_b in zip(touched.tolist(), quick.tolist(), end.tolist()):
            r = self.requests[step.rids[b]]
            if is_quick:
                tokens, page = next(filled_pages)
                if not r.chain_open or r.registered == end_b // ps - 1:  # else the general way below
                    if r.chain_open:
                        self._register_page(r, tuple(tokens), page)
                    r.tokens, r.token_base = [], end_b
                    continue
            self._fold_tail(r)
            self._register_full_pages(r)
            self._trim_history(r)
        R.known_end[quick_rows] = quick_end  # either way, their lists now end where the cache does

    def _register_full_pages(self, r: Request) -> None:
        R = self.rows
        full = int(R.computed[r.row]) // self.page_size
        if self.streaming is not None:
            full = min(full, self.sink_pages)  # only sink pages are ever shared under StreamingLLM
        first_page = int(R.first_page[r.row])
        while r.chain_open and r.registered < full:
            j = r.registered
            if j < first_page:  # released by the window before it could be registered
                r.chain_open = False
                return
            page = int(R.table[r.row, j - first_page]) // self.page_size
            self._register_page(r, tuple(r.known(j * self.page_size, (j + 1) * self.page_size)), page)

    def _register_page(self, r: Request, tokens: tuple, page: int) -> None:
        """Publishes ``page`` (holding ``tokens``) as the next page of the request's chain, or closes
        the chain when its hash is taken by other content (only a weak ``hash_fn`` collides)."""
        h = self.index.hash_fn(r.chain_tail[0], tokens, r.identity)
        stale = self.index.unreachable_page(h, r.chain_tail[1], tokens, r.identity)
        if stale is not None:  # the same content, registered after a parent since evicted: this page replaces it
            self.index.remove_page(stale)
            self.pool.forget_cached(stale)  # a cached one is free now; a referenced one stays its requests', unshared
        entry = self.index.register(h, page, r.chain_tail[1], tokens, r.identity)
        if entry is None:
            r.chain_open = False
            return
        r.chain_tail = (h, entry.node)
        r.registered += 1

    def _trim_history(self, r: Request) -> None:
        """Drops token ids no later step needs, so a request's host memory stays O(window + chunk)."""
        if self.streaming is not None:
            return  # re-evaluation re-feeds kept tokens; the budget bounds them
        keep_from = int(self.rows.computed[r.row])
        if r.chain_open:
            keep_from = min(keep_from, r.registered * self.page_size)
        if keep_from > r.token_base:
            del r.tokens[:keep_from - r.token_base]
            r.token_base = keep_from
