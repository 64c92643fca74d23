"""Host-side paged KV-cache manager: page tables, prefix caching, sliding window, StreamingLLM; it
produces exactly the KeyValueCache op's index inputs (cache_mode 1) for each scheduler step.

Steps are transactions. ``schedule`` plans a step and reserves its pages; the caller runs the op on
the plan and then either ``commit(plan)`` (the step ran: its full pages are published for prefix
reuse) or ``abort(plan)`` (it did not: the step is rolled back). One step is outstanding at a time.
A page is therefore never offered as a prefix hit before the caller confirmed it was written.

Every call validates all of its arguments before it changes anything: on any exception the manager
is exactly as before the call.

A step costs a fixed number of numpy operations over the batch plus Python work only for requests
whose step is more than appending one generated token (see ``schedule``): each request's page table,
positions and recent decode tokens live in persistent arrays (:class:`RequestRows`).
"""

import operator

import numpy as np

from .errors import OutOfPages, UnknownRequest
from .identity import (DEFAULT_VOCAB_SIZE, check_int, check_vocab_size, key_bytes, page_identity, token_array,
                       token_batch, token_ids)
from .page_pool import PagePool
from .prefix_index import PrefixIndex
from .request_rows import RequestRows
from .step_plan import StepPlan, build_plan
from .step_records import OutstandingStep, PlannedStep, Request, RequestUndo, RequestWork
from .streaming import StreamingPolicy, streaming_discard

#: Request ids of these exact types name the same request exactly when they compare equal (equal values hash
#: alike, and comparing never raises), so a list of them equal to the last batch's names the same requests.
#: Other ids (numpy scalars, tuples, floats, custom classes) can be equal without being the same dict key, or
#: fail to compare: their batches are looked up afresh every step.
_PLAIN_IDS = frozenset((int, str))

__all__ = ["KVCacheManager", "StepPlan", "StreamingPolicy"]


class KVCacheManager:
    """Pages of ``page_size`` slots out of ``num_pages``; page tables up to ``max_pages`` wide.

    ``sliding_window`` (W): a query at position q sees keys (q - W, q]; pages wholly before every
    query's window are released. ``cache_key`` (e.g. the cache's dtype and quant settings: ``None``,
    bools, ints, strings, bytes and tuples of them) joins every page's identity, as does a request's
    ``salt`` (``str`` or ``bytes``; tenant isolation: different salts never share pages). Token ids
    must be integers in ``[0, vocab_size)``. ``hash_fn(parent_hash, tokens, identity)`` replaces the
    keyed page hash (tests only).
    """

    def __init__(self, num_pages: int, page_size: int, max_pages: int, *, sliding_window=None, cache_key=(),
                 hash_fn=None, streaming: StreamingPolicy = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
        num_pages, page_size = check_int("num_pages", num_pages), check_int("page_size", page_size)
        max_pages = check_int("max_pages", max_pages)
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size and max_pages must be >= 1, got {page_size}, {max_pages}")
        if sliding_window is not None:
            sliding_window = check_int("sliding_window", sliding_window)
            if sliding_window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.vocab_size = check_vocab_size(vocab_size)
        key_bytes(cache_key)  # a TypeError now rather than at the first request
        self.sink_pages = 0
        if streaming is not None:
            if sliding_window is not None:
                raise ValueError("streaming and sliding_window are alternatives; configure one")
            streaming = StreamingPolicy(check_int("streaming sinks", streaming.sinks),
                                        check_int("streaming budget_pages", streaming.budget_pages), streaming.mode)
            sinks = streaming.sinks
            if sinks < 0:
                raise ValueError(f"streaming sinks must be >= 0, got {sinks}")
            if streaming.mode not in ("shift", "reevaluate"):
                raise ValueError(f"streaming mode must be 'shift' or 'reevaluate', got {streaming.mode!r}")
            self.sink_pages = -(-sinks // page_size)
            if not self.sink_pages + 1 < streaming.budget_pages <= max_pages:
                raise ValueError(f"streaming budget_pages must be in ({self.sink_pages + 1}, max_pages={max_pages}], "
                                 f"got {streaming.budget_pages}")
        self.streaming = streaming
        self.page_size = page_size
        self.max_pages = max_pages
        self.sliding_window = sliding_window
        self.cache_key = cache_key
        self.index = PrefixIndex(hash_fn)
        self.pool = PagePool(num_pages, on_evict=self.index.remove_page)
        self.rows = RequestRows(max_pages, page_size)
        self.requests = {}  # rid -> Request
        self._row_of = {}  # rid -> row (the batch lookup of a step)
        # (request ids, their rows) of the last batch looked up: a decode loop feeds the same batch step
        # after step, and comparing the id lists is cheaper than looking each id up again. An active
        # request keeps its row, so only finish() makes it stale (and admitting one cannot: a listed id
        # was active, so it is not being admitted).
        self._last_batch = None
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._pending = None  # the outstanding OutstandingStep

    # ---- admission ---------------------------------------------------------------------------------
    def add_request(self, rid, prompt, salt=None) -> int:
        """Admits a request; returns how many prompt tokens come from the prefix cache (full pages only,
        and never the last prompt token: a step must compute at least one token to produce logits).
        ``TypeError``/``ValueError`` (nothing changed) for a bad prompt or salt."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already active")
        prompt = token_ids(prompt, self.vocab_size, f"request {rid!r}: prompt")
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        if self.sliding_window is None and self.streaming is None and \
                -(-len(prompt) // self.page_size) > self.max_pages:
            raise ValueError(f"request {rid!r}: a prompt of {len(prompt)} tokens needs more than "
                             f"max_pages={self.max_pages} pages of {self.page_size}")
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
        if len(pages) > self.max_pages:  # only a window wider than max_pages pages gets here
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

    # ---- steps ---------------------------------------------------------------------------------------
    def schedule(self, feeds: dict) -> StepPlan:
        """Plans one step. ``feeds`` maps request id -> the token ids fed this step (a prefill chunk of
        the prompt, or generated tokens). Raises :class:`OutOfPages` when the pages cannot be had,
        ``ValueError``/``TypeError`` for a step no page table can describe, ``RuntimeError`` while an
        earlier step is outstanding — in every case with nothing changed.

        Cost: a fixed number of numpy operations over the batch, plus Python work per request only
        where the step does more than append one generated token (a prefill chunk, several tokens, a
        window release, a StreamingLLM discard; a new page costs one pool operation) — proportional to
        what changes, not to the requests' context lengths."""
        self._check_idle()
        if not isinstance(feeds, dict):
            raise TypeError(f"feeds must be a dict of request id -> token ids, got {type(feeds).__name__}")
        rids = list(feeds)
        batch = self._batch_of(feeds, rids)
        if batch is None:
            batch = self._check_each(feeds)  # raises the first request's error, in feed order
        return self._schedule(rids, batch, feeds)

    def schedule_decode(self, request_ids, tokens) -> StepPlan:
        """Plans a step that feeds one token to each request: ``tokens[i]`` to ``request_ids[i]`` (a list
        or tuple of distinct active ids; ``tokens`` a 1-D integer array or a sequence of ints of the
        same length). Exactly ``schedule({rid: [token], ...})`` — the same plan, the same effect, the
        same errors with nothing changed — without a dict and a list per request, for large decode
        batches."""
        self._check_idle()
        if not isinstance(request_ids, (list, tuple)):
            raise TypeError(f"request_ids must be a list or tuple, got {type(request_ids).__name__}")
        rids = list(request_ids)
        ids = token_array(tokens, len(rids), self.vocab_size, "schedule_decode: tokens")
        rows = self._rows_of(rids)
        return self._schedule(rids, (rows, None, ids), None)

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError("the previous step is outstanding: commit(plan) once the op ran it, or abort(plan)")

    def _schedule(self, rids: list, batch: tuple, feeds) -> StepPlan:
        """Plans and applies the step of a checked batch (``feeds``: the step as a dict, or None for one
        token each, to name the first bad request when planning fails)."""
        rows, lengths, ids = batch
        before = self.rows.state.take(rows, axis=0)  # also what abort restores
        try:
            planned = self._plan(rids, before, lengths, ids)
        except ValueError:
            self._check_each(feeds if feeds is not None else {rid: [t] for rid, t in zip(rids, ids.tolist())})
            raise
        freed = sum(1 for w in planned.work for p in w.released if self.pool.ref_count[p] == 1)
        if planned.new_pages > self.pool.available() + freed:
            raise OutOfPages(planned.new_pages, self.pool.available() + freed)
        return self._apply(rids, rows, before, lengths, ids, planned)

    def commit(self, plan: StepPlan) -> None:
        """The step of ``plan`` ran (the op stored its keys): its full pages are published for prefix
        reuse and history no longer needed is dropped."""
        step = self._outstanding(plan, "commit")
        R, ps = self.rows, self.page_size
        # A plain append has something to publish only when it filled its page.
        filled = step.end % ps == 0
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

    def abort(self, plan: StepPlan) -> None:
        """The step of ``plan`` did not run: rolls it back, so the manager is as before ``schedule``
        except that cached pages the step evicted stay evicted (they may have been written).

        Rolling back assumes the step wrote nothing (it never ran, or its op failed — the op leaves the
        cache unchanged on error). If part of a step may have run (a multi-layer model failing after
        its first layer, or a StreamingLLM shift already applied), ``abort`` and then ``finish`` every
        request of the plan instead: nothing of the step was ever published, so no other request can
        read what it wrote."""
        step = self._outstanding(plan, "abort")
        for page in reversed(step.taken):
            self.pool.untake(page)
        for page in reversed(step.released):
            self.pool.reclaim(page)
        if step.appended is not None:
            self.rows.table[step.appended] = -1
        for u in step.undo:
            u.restore(self.rows)
        self.rows.state[step.rows] = step.before

    def reset_prefix_cache(self) -> None:
        """Forgets every published page: cached pages become free, and pages of live requests stay
        theirs but are no longer offered to others (nor are their later pages)."""
        self.index.clear()
        self.pool.drop_cached()
        for r in self.requests.values():
            r.chain_open = False

    def _outstanding(self, plan: StepPlan, verb: str) -> OutstandingStep:
        step = self._pending
        if step is None or step.plan is not plan:
            raise ValueError(f"{verb}: this plan is not the outstanding step (each plan is committed or "
                             f"aborted once, before the next schedule)")
        self._pending = None
        return step

    # ---- planning (no change) ----------------------------------------------------------------------
    def _batch_of(self, feeds: dict, rids: list):
        """(rows, lengths, ids) of a batch of known requests fed lists of valid ids, in one pass
        (``lengths`` None when every request is fed one token); None when that does not hold (the
        per-request check then finds out why)."""
        if not rids:
            return np.zeros(0, np.intp), None, np.zeros(0, np.int64)
        rows = self._cached_rows(rids)
        if rows is None:
            try:
                rows = operator.itemgetter(*rids)(self._row_of)
            except (KeyError, TypeError):  # TypeError: an unhashable id
                return None
            rows = self._remember_rows(rids, np.array(rows if len(rids) > 1 else [rows], np.intp))
        tokens = token_batch(list(feeds.values()), self.vocab_size)
        if tokens is None:
            return None
        return rows, tokens[0], tokens[1]

    def _rows_of(self, rids: list) -> np.ndarray:
        """The rows of distinct active requests; ``UnknownRequest``/``ValueError`` otherwise."""
        cached = self._cached_rows(rids)
        if cached is not None:
            return cached
        try:
            rows = operator.itemgetter(*rids)(self._row_of) if len(rids) > 1 else [self._row_of[r] for r in rids]
        except (KeyError, TypeError):
            for rid in rids:
                self._get(rid)  # raises for the first unknown one
            raise
        rows = np.array(rows, np.intp)
        if len(rows) > 1 and np.bincount(rows).max() > 1:
            seen = set()
            for rid in rids:
                if rid in seen:
                    raise ValueError(f"request {rid!r} appears twice in one step")
                seen.add(rid)
        return self._remember_rows(rids, rows)

    def _cached_rows(self, rids: list):
        """The rows of ``rids`` if they are the last batch's ids, in the same order; else None. Only
        lists of plain ids are compared (see ``_PLAIN_IDS``)."""
        last = self._last_batch
        if last is None or len(last[0]) != len(rids) or not set(map(type, rids)) <= _PLAIN_IDS:
            return None
        return last[1] if last[0] == rids else None

    def _remember_rows(self, rids: list, rows: np.ndarray) -> np.ndarray:
        """Keeps ``rows`` (made read-only: plans and records share it) as the rows of ``rids`` (the
        caller's own list, which nothing changes later) for the next step's lookup, if the ids are
        plain."""
        rows.flags.writeable = False
        self._last_batch = (rids, rows) if set(map(type, rids)) <= _PLAIN_IDS else None
        return rows

    def _check_each(self, feeds: dict) -> tuple:
        """The batch of ``feeds`` checked request by request, exactly as a step would use it; raises the
        error of the first bad request (unknown, bad or empty tokens, tokens that contradict the
        prompt, a step no page table can describe)."""
        rows, lengths, ids = [], [], []
        for rid, tokens in feeds.items():
            r = self._get(rid)
            tokens = token_ids(tokens, self.vocab_size, f"request {rid!r}: fed tokens")
            self._check_feed(r, tokens)
            self._plan_request(0, r, tokens)
            rows.append(r.row)
            lengths.append(len(tokens))
            ids += tokens
        return np.array(rows, np.intp), np.array(lengths, np.int64), np.array(ids, np.int64)

    def _check_feed(self, r: Request, tokens: list) -> None:
        if not tokens:
            raise ValueError(f"request {r.rid!r}: a step must feed at least one token")
        c = int(self.rows.computed[r.row])
        known = r.known(c, c + len(tokens))
        if tokens[:len(known)] != known:
            raise ValueError(f"request {r.rid!r}: fed tokens differ from the prompt at positions {c}..")

    def _plan(self, rids, before, lengths, ids) -> PlannedStep:
        """What the step does to each request, from the rows as they are (``before``); ``ValueError``
        for a step no page table can describe."""
        ps = self.page_size
        computed, first, held, known_end = before.T
        end = computed + (1 if lengths is None else lengths)
        # A plain append: one generated token (nothing of the prompt to check), at most one new page,
        # nothing released by the window, no StreamingLLM discard.
        plain = computed >= known_end
        if lengths is not None:
            plain &= lengths == 1
        if self.sliding_window is not None:
            plain &= np.maximum(computed - self.sliding_window + 1, 0) // ps <= first
        if self.streaming is not None:
            plain &= end <= self.streaming.budget_pages * ps
        need = computed >= (first + held) * ps  # for a plain append: the token starts a new page
        all_plain = np.count_nonzero(plain) == len(plain)
        if not all_plain:
            need &= plain
        new_pages = int(np.count_nonzero(need))
        # (the maximum first: one reduction where, as almost always, no request holds max_pages pages)
        if new_pages and held.max() >= self.max_pages and (held[need] >= self.max_pages).any():
            raise ValueError("a request's step needs more than max_pages pages")  # _check_each says which
        work = []
        if not all_plain:
            need = need.astype(np.int64)
            ends = np.arange(1, len(rids) + 1) if lengths is None else np.cumsum(lengths)
            starts = (ends - 1 if lengths is None else ends - lengths).tolist()
            ends = ends.tolist()
            for b in np.flatnonzero(~plain).tolist():
                r = self.requests[rids[b]]
                tokens = ids[starts[b]:ends[b]].tolist()
                self._check_feed(r, tokens)
                w = self._plan_request(b, r, tokens)
                need[b], end[b] = w.new_pages, w.end
                new_pages += w.new_pages
                work.append(w)
        return PlannedStep(end, None if all_plain else plain, need, new_pages, work)

    def _plan_request(self, b: int, r: Request, tokens: list) -> RequestWork:
        ps, R, row = self.page_size, self.rows, r.row
        computed, first_page, held = int(R.computed[row]), int(R.first_page[row]), int(R.npages[row])
        discard, dropped = (streaming_discard(self.streaming, self.sink_pages, ps, r.rid, computed, held, len(tokens))
                            if self.streaming is not None else (0, 0))
        end = computed - dropped + len(tokens)
        first = first_page
        if self.sliding_window is not None:
            first = max(first, max(0, computed - self.sliding_window + 1) // ps)
        pages_total = -(-end // ps)
        if pages_total - first > self.max_pages:
            raise ValueError(f"request {r.rid!r}: {pages_total - first} pages exceed max_pages={self.max_pages}")
        released = []
        if discard:
            s = self.sink_pages
            released = R.pages(row)[s:s + discard] if self.streaming.mode == "shift" else R.pages(row)[s:]
        elif first > first_page:
            released = R.pages(row)[:first - first_page]
        new_pages = pages_total - first - (held - len(released))
        return RequestWork(b, r, tokens, discard, dropped, end, first, released, new_pages)

    # ---- applying ------------------------------------------------------------------------------------
    def _apply(self, rids, rows, before, lengths, ids, planned: PlannedStep) -> StepPlan:
        ps, R, plain, need = self.page_size, self.rows, planned.plain, planned.need
        step = OutstandingStep(None, rids, rows, before, planned.end, plain, [], None, [], [])
        fed, shift_slots, shift_deltas = {}, [], []
        for w in planned.work:  # every release before any allocation: schedule() counted on them
            r = w.r
            step.undo.append(RequestUndo(r, r.token_base, list(r.tokens) if w.discard else None, len(r.tokens),
                                   R.table[r.row].copy()))
            self._fold_tail(r)
            if w.discard:
                slots, refeed = self._discard(r, w)
                if slots.size:
                    shift_slots.append(slots)
                    shift_deltas.append(np.full(slots.size, -w.dropped, np.int64))
                fed[w.b] = refeed + w.tokens
            elif w.released:
                self._drop_first_pages(r.row, len(w.released))
                R.first_page[r.row] = w.first
            for page in w.released:
                self.pool.release(page, cached=self.index.is_cached(page))
            step.released += w.released
        if planned.new_pages:  # pages in batch order, as each request asks for them
            step.taken = self.pool.take_many(planned.new_pages)
            self._hand_out(step, np.array(step.taken, np.int64) * ps, need, planned.work)
        # A plain append puts its token in the tail buffer; the request's token list stays as it is.
        computed = before[:, 0]
        if plain is None:
            R.tail[rows, computed % ps] = ids
        else:
            first_ids = ids if lengths is None else ids[np.cumsum(lengths) - lengths]
            R.tail[rows[plain], computed[plain] % ps] = first_ids[plain]
        R.computed[rows] = planned.end
        for w in planned.work:
            r, tokens = w.r, fed.get(w.b, w.tokens)
            start = w.end - len(tokens)
            r.tokens[start - r.token_base:w.end - r.token_base] = tokens
            R.known_end[r.row] = r.token_base + len(r.tokens)
        if fed:  # StreamingLLM re-evaluation feeds kept tokens again: lengths and ids change
            lengths, ids = self._refed(lengths, ids, fed)
        first_slot = (before[:, 1] if plain is None else R.first_page[rows]) * ps
        step.plan = build_plan(
            list(rids), lengths, planned.end, first_slot, R.table.take(rows, axis=0),
            self._fed_tokens(rids, lengths, ids),
            np.concatenate(shift_slots) if shift_slots else None,
            np.concatenate(shift_deltas) if shift_deltas else None)
        self._pending = step
        return step.plan

    def _hand_out(self, step: OutstandingStep, slots: np.ndarray, need: np.ndarray, work: list) -> None:
        """Appends the pages just taken (``slots``: their first slots, in batch order) to the page tables
        of the requests that asked for them (``need``: how many each)."""
        R, rows = self.rows, step.rows
        if step.plain is None:  # every request's step is plain: need is a bool mask
            appended = np.flatnonzero(need)
            offsets, starts = np.arange(len(appended)), None
        else:
            starts = np.cumsum(need) - need
            appended = np.flatnonzero(step.plain & (need > 0))
            offsets = starts[appended]
        cols = step.before[appended, 2]
        step.appended = (rows[appended], cols)
        R.table[step.appended] = slots[offsets]
        R.npages[rows[appended]] = cols + 1
        for w in work:
            n0, start = int(R.npages[w.r.row]), int(starts[w.b])
            R.table[w.r.row, n0:n0 + w.new_pages] = slots[start:start + w.new_pages]
            R.npages[w.r.row] = n0 + w.new_pages

    @staticmethod
    def _refed(lengths, ids, fed: dict) -> tuple:
        """(lengths, ids) of a batch after some requests' feeds were replaced (``fed``: index -> ids)."""
        lengths = np.ones(len(ids), np.int64) if lengths is None else lengths.copy()
        flat, ends, all_fed = ids.tolist(), np.cumsum(lengths).tolist(), []
        for b, (end, n) in enumerate(zip(ends, lengths.tolist())):
            all_fed += fed.get(b, flat[end - n:end])
        for b, tokens in fed.items():
            lengths[b] = len(tokens)
        return lengths, np.array(all_fed, np.int64)

    @staticmethod
    def _fed_tokens(rids: list, lengths, ids: np.ndarray):
        """A function building the plan's ``fed_tokens`` on demand (from arrays no one else changes)."""

        def build() -> dict:
            flat = ids.tolist()
            if lengths is None:
                return {rid: [token] for rid, token in zip(rids, flat)}
            ends = np.cumsum(lengths).tolist()
            return {rid: flat[end - n:end] for rid, end, n in zip(rids, ends, lengths.tolist())}

        return build

    def _drop_first_pages(self, row: int, k: int) -> None:
        """Removes the first ``k`` retained pages from the row's table (the window moved past them)."""
        R, n = self.rows, int(self.rows.npages[row])
        R.table[row, :n - k] = R.table[row, k:n].copy()
        R.table[row, n - k:n] = -1
        R.npages[row] = n - k

    def _fold_tail(self, r: Request) -> None:
        """Moves the decode tokens held in the row's tail buffer onto the request's token list."""
        R, row = self.rows, r.row
        known_end, computed = int(R.known_end[row]), int(R.computed[row])
        if computed > known_end:
            r.tokens += R.tail[row, np.arange(known_end, computed) % self.page_size].tolist()
            R.known_end[row] = computed

    # ---- StreamingLLM --------------------------------------------------------------------------------
    def _discard(self, r: Request, w: RequestWork) -> tuple:
        """Drops ``w.discard`` pages (``w.dropped`` positions) after the sinks. Returns (slots to shift by
        ``-w.dropped``, tokens to re-feed)."""
        R, row, ps, s = self.rows, r.row, self.page_size, self.sink_pages
        sink_end = s * ps
        old_computed, held = int(R.computed[row]), int(R.npages[row])
        del r.tokens[sink_end - r.token_base:sink_end + w.dropped - r.token_base]
        R.known_end[row] -= w.dropped
        if self.streaming.mode == "shift":
            kept_positions = np.arange(sink_end + w.dropped, old_computed)
            slots = R.table[row, kept_positions // ps] + kept_positions % ps
            R.table[row, s:held - w.discard] = R.table[row, s + w.discard:held].copy()
            R.table[row, held - w.discard:held] = -1
            R.npages[row] = held - w.discard
            R.computed[row] = old_computed - w.dropped
            return slots, []
        R.table[row, s:held] = -1
        R.npages[row] = s
        R.computed[row] = sink_end
        return np.zeros(0, np.int64), r.known(sink_end, old_computed - w.dropped)

    # ---- publishing --------------------------------------------------------------------------------
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

    # ---- inspection --------------------------------------------------------------------------------
    def _get(self, rid) -> Request:
        try:
            return self.requests[rid]
        except KeyError:
            raise UnknownRequest(rid) from None

    def page_table(self, rid) -> list:
        """Page ids of a request's retained pages, in position order."""
        return self.rows.pages(self._get(rid).row)

    def computed(self, rid) -> int:
        """Positions of the request stored in the cache (after the outstanding step, if any)."""
        return int(self.rows.computed[self._get(rid).row])

    def pending_tokens(self, rid) -> list:
        """Prompt token ids not yet fed."""
        r = self._get(rid)
        return r.known(int(self.rows.computed[r.row]), r.token_base + len(r.tokens))

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
