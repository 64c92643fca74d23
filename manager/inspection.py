"""Reading a manager's state: page tables, positions, pending prompt tokens, metrics, and the bookkeeping
invariants the tests assert: part of :class:`~.kv_manager.KVCacheManager`."""

from .identity import check_int
from .streaming import streaming_discard, streaming_room


class Inspection:
    """The manager's read-only views (of its ``rows``, ``requests``, ``pool`` and ``index``)."""

    def page_table(self, rid) -> list:
        """Page ids of a request's retained pages, in position order."""
        return self.rows.pages(self._get(rid).row)

    def computed(self, rid) -> int:
        """Positions of the request stored in the cache (after the outstanding step, if any)."""
        return int(self.rows.computed[self._get(rid).row])

    def step_room(self, rid):
        """The most tokens the next step of ``rid`` may feed for its cache to depend on its tokens alone, not on
        how its steps were chunked (StreamingLLM: see :func:`~.streaming.streaming_room`); ``None``: no limit.
        :class:`~.errors.UnknownRequest` for an id that is not active, with or without StreamingLLM."""
        computed = self.computed(rid)
        if self.streaming is None:
            return None
        return streaming_room(self.streaming, self.sink_pages, self.page_size, computed)

    def refed_tokens(self, rid, n_new: int) -> int:
        """How many kept tokens a step feeding ``n_new`` tokens to ``rid`` feeds again besides them (StreamingLLM's
        "reevaluate" discard re-feeds what it keeps); 0 where it discards nothing, in another mode, or where the step
        cannot fit (the schedule says why). ``n_new`` must be an integer >= 1 (a step feeds at least one token)."""
        row = self._get(rid).row
        n_new = check_int("n_new", n_new)
        if n_new < 1:
            raise ValueError(f"n_new must be >= 1 (a step feeds at least one token), got {n_new}")
        if self.streaming is None or self.streaming.mode != "reevaluate":
            return 0
        computed, held = int(self.rows.computed[row]), int(self.rows.npages[row])
        try:
            discard, dropped = streaming_discard(self.streaming, self.sink_pages, self.page_size, rid, computed, held,
                                                 n_new)
        except ValueError:
            return 0
        return computed - self.sink_pages * self.page_size - dropped if discard else 0

    def pending_tokens(self, rid) -> list:
        """Prompt token ids not yet fed."""
        r = self._get(rid)
        return r.known(int(self.rows.computed[r.row]), r.token_base + len(r.tokens))

    def has_pending_tokens(self, rid) -> bool:
        """Whether prompt tokens are still to be fed: ``bool(pending_tokens(rid))`` without building the list
        (asked once per running request per step)."""
        r = self._get(rid)
        return int(self.rows.computed[r.row]) < r.token_base + len(r.tokens)

    def metrics(self) -> dict:
        """Prefix-cache and pool figures."""
        return {
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            "evictions": self.pool.evictions,
            **self.pool.counts(),
        }

    def check(self) -> None:
        """Asserts the bookkeeping invariants (tests): exact ref counts, no page owned twice by one
        request, page-table rows exactly the op's ``cachestarts`` rows, published pages never free,
        history bounded by what later steps need (at most one page of decode tokens outside the list)."""
        self.pool.check()
        R, ps = self.rows, self.page_size
        assert sorted(self._row_of.values()) == R.live_rows().tolist() == sorted(r.row for r in self.requests.values())
        expected = [0] * self.pool.num_pages
        for rid, r in self.requests.items():
            row = self._row_of[rid]
            assert r.row == row
            pages, first, computed = R.pages(row), int(R.first_page[row]), int(R.computed[row])
            assert len(set(pages)) == len(pages), f"request {rid!r} holds a page twice"
            assert (R.table[row, len(pages):] == -1).all() and (R.table[row, :len(pages)] % ps == 0).all()
            assert first * ps <= computed <= (first + len(pages)) * ps
            known_end = r.token_base + len(r.tokens)
            assert int(R.known_end[row]) == known_end
            assert r.token_base <= computed <= known_end + ps, "more than a page of tokens outside the list"
            for page in pages:
                expected[page] += 1
        assert expected == self.pool.ref_count, "ref counts differ from the page tables"
        for page in self.index.by_page:
            assert self.pool.ref_count[page] > 0 or page in self.pool.cached, f"cached page {page} is free"
        assert all(page in self.index.by_page for page in self.pool.cached), "an unregistered page is cached"
        assert self.index.nodes == {self.index.ROOT, *(e.node for e in self.index.by_hash.values())}
