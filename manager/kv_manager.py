"""Host-side paged KV-cache manager: page tables, prefix caching, sliding window, StreamingLLM; it
produces exactly the KeyValueCache op's index inputs (cache_mode 1) for each scheduler step.

Steps are transactions. ``schedule`` plans a step and reserves its pages; the caller runs the op on
the plan and then either ``commit(plan)`` (the step ran: its full pages are published for prefix
reuse) or ``abort(plan)`` (it did not: the step is rolled back). One step is outstanding at a time.
A page is therefore never offered as a prefix hit before the caller confirmed it was written.

Every call validates all of its arguments before it changes anything: on any exception the manager
is exactly as before the call.
"""

import dataclasses

import numpy as np

from .errors import OutOfPages, UnknownRequest
from .identity import DEFAULT_VOCAB_SIZE, check_int, check_vocab_size, key_bytes, page_identity, token_ids
from .page_pool import PagePool
from .prefix_index import PrefixIndex


@dataclasses.dataclass
class _Request:
    rid: object
    identity: bytes  # salt + cache settings: part of every page's identity
    tokens: list  # ids of positions [token_base, token_base + len(tokens)): the prompt, then what was fed
    token_base: int = 0  # positions before it are no longer needed (registered or outside the window)
    computed: int = 0  # positions [0, computed) are stored in the cache
    pages: list = dataclasses.field(default_factory=list)  # page ids of page indices first_page, first_page+1, ..
    first_page: int = 0  # pages before it were released (sliding window)
    registered: int = 0  # pages [0, registered) are in the prefix index, in chain order
    chain_tail: tuple = (None, PrefixIndex.ROOT)  # (hash, node) of page registered - 1
    chain_open: bool = True  # False once a page could not be registered: no later page can be

    def known(self, begin: int, end: int) -> list:
        """Token ids of positions [begin, end) that are known (prompt or fed)."""
        return self.tokens[begin - self.token_base:end - self.token_base]


@dataclasses.dataclass(frozen=True)
class StreamingPolicy:
    """StreamingLLM: keep ``sinks`` first tokens (rounded up to whole pages) plus the most recent ones
    within ``budget_pages`` pages per request. When a step would exceed the budget, at least half of the
    pages after the sinks (and at least what the step needs) are dropped — the positions they held, which
    is less than whole pages when the last one is partly filled — then either

    * ``"shift"``: the kept keys are re-rotated to their new positions — the step's plan carries
      ``shift_slots``/``shift_deltas`` for KeyCacheRotaryShift, to run (every layer) before the op; or
    * ``"reevaluate"``: the kept tokens are fed again at their new positions in this step
      (``StepPlan.fed_tokens``), and their old pages are released.

    Positions are cache positions (contiguous after a discard), as StreamingLLM defines them. Prefix
    reuse and registration cover only the sink pages: later pages are shifted or dropped in place, so
    they are never shared, and no store of a step ever lands in a sink page once it is full.
    """

    sinks: int
    budget_pages: int
    mode: str = "shift"


@dataclasses.dataclass
class StepPlan:
    """One step: the op's index inputs plus the absolute positions RoPE and the mask need."""

    request_ids: list
    seqstarts: np.ndarray  # [B+1]
    kvstarts: np.ndarray  # [B+1]
    cachestarts: np.ndarray  # [B, MaxP] slot of each page (-1 unused)
    start_pos: np.ndarray  # [B] position in the op's view (relative to the first retained page)
    max_seqlen: np.ndarray  # scalar
    max_kvlen: np.ndarray  # scalar
    query_positions: np.ndarray  # [seqstarts[B]] absolute position of every fed token
    key_positions: np.ndarray  # [kvstarts[B]] absolute position of every gathered key
    fed_tokens: dict = dataclasses.field(default_factory=dict)  # rid -> tokens fed (re-evaluated ones first)
    shift_slots: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # [S]
    shift_deltas: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))  # [S] positions

    def op_inputs(self) -> dict:
        """The op's index inputs by name (cache_mode 1)."""
        return {"seqstarts": self.seqstarts, "kvstarts": self.kvstarts, "cachestarts": self.cachestarts,
                "start_pos": self.start_pos, "max_seqlen": self.max_seqlen, "max_kvlen": self.max_kvlen}


@dataclasses.dataclass
class _Work:
    """One request's part of a step, computed (and validated) before anything changes."""

    r: _Request
    tokens: list  # new token ids
    discard: int  # StreamingLLM: pages dropped after the sinks
    dropped: int  # StreamingLLM: positions those pages held
    end: int  # cache positions [0, end) are stored after the step
    first: int  # first retained page after the step
    released: list  # pages the step gives back (window or discard)


@dataclasses.dataclass
class _Undo:
    """What a step changed in one request, to roll it back."""

    r: _Request
    computed: int
    token_base: int
    tokens: list  # a copy when the step deletes tokens (discard), else None: tokens are only extended
    tokens_len: int
    pages: list  # a copy when the step releases pages, else None: pages are only appended
    pages_len: int
    first_page: int

    @classmethod
    def of(cls, r: _Request, rewrites_tokens: bool, rewrites_pages: bool) -> "_Undo":
        return cls(r, r.computed, r.token_base, list(r.tokens) if rewrites_tokens else None, len(r.tokens),
                   list(r.pages) if rewrites_pages else None, len(r.pages), r.first_page)

    def restore(self) -> None:
        r = self.r
        r.computed, r.token_base, r.first_page = self.computed, self.token_base, self.first_page
        r.tokens = self.tokens if self.tokens is not None else r.tokens[:self.tokens_len]
        r.pages = self.pages if self.pages is not None else r.pages[:self.pages_len]


@dataclasses.dataclass
class _Step:
    """The outstanding step: its plan and what it changed."""

    plan: StepPlan
    undo: list
    taken: list  # pages taken from the pool, in order
    released: list  # pages released to the pool, in order

    def holds(self, rid) -> bool:
        """True iff the step schedules request ``rid`` (kept here: the caller may change the plan)."""
        return any(u.r.rid == rid for u in self.undo)


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
        self.requests = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        self._pending = None  # the outstanding _Step

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
        r = _Request(rid, page_identity(salt, self.cache_key), prompt)
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
        r.computed = len(hits) * self.page_size
        if self.sliding_window is not None:  # hit pages wholly before the first query's window are not held
            r.first_page = max(0, r.computed - self.sliding_window + 1) // self.page_size
        r.pages = hits[r.first_page:]
        for page in r.pages:
            self.pool.acquire(page)
        self.queried_tokens += len(prompt)
        self.hit_tokens += r.computed
        self.requests[rid] = r
        return r.computed

    def finish(self, rid) -> None:
        """Releases a request's pages (registered ones stay cached for reuse until evicted)."""
        r = self._get(rid)
        if self._pending is not None and self._pending.holds(rid):
            raise RuntimeError(f"request {rid!r} is in the outstanding step: commit(plan) or abort(plan) first")
        for page in reversed(r.pages):  # tail first: eviction (LRU) then takes a chain's end before its root
            self.pool.release(page, cached=self.index.is_cached(page))
        del self.requests[rid]

    # ---- steps ---------------------------------------------------------------------------------------
    def schedule(self, feeds: dict) -> StepPlan:
        """Plans one step. ``feeds`` maps request id -> the token ids fed this step (a prefill chunk of
        the prompt, or generated tokens). Raises :class:`OutOfPages` when the pages cannot be had,
        ``ValueError``/``TypeError`` for a step no page table can describe, ``RuntimeError`` while an
        earlier step is outstanding — in every case with nothing changed."""
        if self._pending is not None:
            raise RuntimeError("the previous step is outstanding: commit(plan) once the op ran it, or abort(plan)")
        if not isinstance(feeds, dict):
            raise TypeError(f"feeds must be a dict of request id -> token ids, got {type(feeds).__name__}")
        work, new_pages, released = [], 0, []
        for rid, tokens in feeds.items():
            r = self._get(rid)
            tokens = token_ids(tokens, self.vocab_size, f"request {rid!r}: fed tokens")
            if not tokens:
                raise ValueError(f"request {rid!r}: a step must feed at least one token")
            known = r.known(r.computed, r.computed + len(tokens))
            if tokens[:len(known)] != known:
                raise ValueError(f"request {rid!r}: fed tokens differ from the prompt at positions {r.computed}..")
            w = self._plan_request(r, tokens)
            kept = len(r.pages) - len(w.released)
            new_pages += -(-w.end // self.page_size) - w.first - kept
            released += w.released
            work.append(w)
        freed = sum(1 for p in released if self.pool.ref_count[p] == 1)
        if new_pages > self.pool.available() + freed:
            raise OutOfPages(new_pages, self.pool.available() + freed)
        return self._apply(work)

    def commit(self, plan: StepPlan) -> None:
        """The step of ``plan`` ran (the op stored its keys): its full pages are published for prefix
        reuse and history no longer needed is dropped."""
        step = self._outstanding(plan, "commit")
        for u in step.undo:
            self._register_full_pages(u.r)
            self._trim_history(u.r)

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
        for u in step.undo:
            u.restore()

    def reset_prefix_cache(self) -> None:
        """Forgets every published page: cached pages become free, and pages of live requests stay
        theirs but are no longer offered to others (nor are their later pages)."""
        self.index.clear()
        self.pool.drop_cached()
        for r in self.requests.values():
            r.chain_open = False

    def _outstanding(self, plan: StepPlan, verb: str) -> _Step:
        step = self._pending
        if step is None or step.plan is not plan:
            raise ValueError(f"{verb}: this plan is not the outstanding step (each plan is committed or "
                             f"aborted once, before the next schedule)")
        self._pending = None
        return step

    def _plan_request(self, r: _Request, tokens: list) -> _Work:
        ps = self.page_size
        discard, dropped = self._streaming_discard(r, len(tokens)) if self.streaming is not None else (0, 0)
        end = r.computed - dropped + len(tokens)
        first = r.first_page
        if self.sliding_window is not None:
            first = max(first, max(0, r.computed - self.sliding_window + 1) // ps)
        pages_total = -(-end // ps)
        if pages_total - first > self.max_pages:
            raise ValueError(f"request {r.rid!r}: {pages_total - first} pages exceed max_pages={self.max_pages}")
        if discard:
            s = self.sink_pages
            released = r.pages[s:s + discard] if self.streaming.mode == "shift" else r.pages[s:]
        else:
            released = r.pages[:first - r.first_page]
        return _Work(r, tokens, discard, dropped, end, first, released)

    def _apply(self, work: list) -> StepPlan:
        ps = self.page_size
        step = _Step(None, [], [], [])
        fed, shift_slots, shift_deltas = {}, [], []
        for w in work:  # every release before any allocation: schedule() counted on them
            r = w.r
            step.undo.append(_Undo.of(r, rewrites_tokens=bool(w.discard), rewrites_pages=bool(w.released)))
            fed[r.rid] = w.tokens
            if w.discard:
                slots, refeed = self._discard(r, w)
                if slots.size:
                    shift_slots.append(slots)
                    shift_deltas.append(np.full(slots.size, -w.dropped, np.int64))
                fed[r.rid] = refeed + w.tokens
            else:
                del r.pages[:len(w.released)]
                r.first_page = w.first
            for page in w.released:
                self.pool.release(page, cached=self.index.is_cached(page))
            step.released += w.released
        seqstarts, kvstarts, start_pos, tables, qpos, kpos = [0], [0], [], [], [], []
        for w in work:
            r, tokens = w.r, fed[w.r.rid]
            while (r.first_page + len(r.pages)) * ps < w.end:
                page = self.pool.take()
                step.taken.append(page)
                r.pages.append(page)
            start, offset = w.end - len(tokens), r.first_page * ps
            seqstarts.append(seqstarts[-1] + len(tokens))
            kvstarts.append(kvstarts[-1] + w.end - offset)
            start_pos.append(start - offset)
            tables.append([p * ps for p in r.pages] + [-1] * (self.max_pages - len(r.pages)))
            qpos.append(np.arange(start, w.end))
            kpos.append(np.arange(offset, w.end))
            r.tokens[start - r.token_base:w.end - r.token_base] = tokens
            r.computed = w.end
        batch = len(work)
        step.plan = StepPlan(
            request_ids=[w.r.rid for w in work],
            seqstarts=np.array(seqstarts, np.int64), kvstarts=np.array(kvstarts, np.int64),
            cachestarts=np.array(tables, np.int64).reshape(batch, self.max_pages),
            start_pos=np.array(start_pos, np.int64),
            max_seqlen=np.array(np.diff(seqstarts).max(initial=0), np.int64),
            max_kvlen=np.array(np.diff(kvstarts).max(initial=0), np.int64),
            query_positions=np.concatenate(qpos) if qpos else np.zeros(0, np.int64),
            key_positions=np.concatenate(kpos) if kpos else np.zeros(0, np.int64),
            fed_tokens=fed,
            shift_slots=np.concatenate(shift_slots) if shift_slots else np.zeros(0, np.int64),
            shift_deltas=np.concatenate(shift_deltas) if shift_deltas else np.zeros(0, np.int64),
        )
        self._pending = step
        return step.plan

    # ---- StreamingLLM --------------------------------------------------------------------------------
    def _streaming_discard(self, r: _Request, n_new: int) -> tuple:
        """(pages after the sinks to drop, positions they hold) before feeding ``n_new`` tokens; (0, 0)
        when the step fits. The last page may be partly filled, so the positions dropped are counted,
        not assumed to be whole pages."""
        ps, budget = self.page_size, self.streaming.budget_pages
        if -(-(r.computed + n_new) // ps) <= budget:
            return 0, 0
        recent = len(r.pages) - self.sink_pages
        discard = max(-(-(r.computed + n_new) // ps) - budget, (recent + 1) // 2)
        dropped = min(discard * ps, r.computed - self.sink_pages * ps)
        if recent <= 0 or discard > recent or -(-(r.computed - dropped + n_new) // ps) > budget:
            raise ValueError(f"request {r.rid!r}: {n_new} new tokens do not fit the streaming budget of "
                             f"{budget} pages even after dropping every page after the sinks")
        return discard, dropped

    def _discard(self, r: _Request, w: _Work) -> tuple:
        """Drops ``w.discard`` pages (``w.dropped`` positions) after the sinks. Returns (slots to shift by
        ``-w.dropped``, tokens to re-feed)."""
        sink_end = self.sink_pages * self.page_size
        old_computed = r.computed
        kept_positions = np.arange(sink_end + w.dropped, old_computed)
        del r.tokens[sink_end - r.token_base:sink_end + w.dropped - r.token_base]
        if self.streaming.mode == "shift":
            pages = np.asarray(r.pages, np.int64)
            slots = pages[kept_positions // self.page_size] * self.page_size + kept_positions % self.page_size
            del r.pages[self.sink_pages:self.sink_pages + w.discard]
            r.computed = old_computed - w.dropped
            return slots, []
        del r.pages[self.sink_pages:]
        r.computed = sink_end
        return np.zeros(0, np.int64), r.known(sink_end, old_computed - w.dropped)

    # ---- publishing --------------------------------------------------------------------------------
    def _register_full_pages(self, r: _Request) -> None:
        full = r.computed // self.page_size
        if self.streaming is not None:
            full = min(full, self.sink_pages)  # only sink pages are ever shared under StreamingLLM
        while r.chain_open and r.registered < full:
            j = r.registered
            if j < r.first_page:  # released by the window before it could be registered
                r.chain_open = False
                return
            tokens = tuple(r.known(j * self.page_size, (j + 1) * self.page_size))
            h = self.index.hash_fn(r.chain_tail[0], tokens, r.identity)
            entry = self.index.register(h, r.pages[j - r.first_page], r.chain_tail[1], tokens, r.identity)
            if entry is None:  # the hash is taken by other content (only a weak hash_fn collides)
                r.chain_open = False
                return
            r.chain_tail = (h, entry.node)
            r.registered += 1

    def _trim_history(self, r: _Request) -> None:
        """Drops token ids no later step needs, so a request's host memory stays O(window + chunk)."""
        if self.streaming is not None:
            return  # re-evaluation re-feeds kept tokens; the budget bounds them
        keep_from = r.computed
        if r.chain_open:
            keep_from = min(keep_from, r.registered * self.page_size)
        if keep_from > r.token_base:
            del r.tokens[:keep_from - r.token_base]
            r.token_base = keep_from

    # ---- inspection --------------------------------------------------------------------------------
    def _get(self, rid) -> _Request:
        try:
            return self.requests[rid]
        except KeyError:
            raise UnknownRequest(rid) from None

    def page_table(self, rid) -> list:
        """Page ids of a request's retained pages, in position order."""
        return list(self._get(rid).pages)

    def computed(self, rid) -> int:
        """Positions of the request stored in the cache (after the outstanding step, if any)."""
        return self._get(rid).computed

    def pending_tokens(self, rid) -> list:
        """Prompt token ids not yet fed."""
        r = self._get(rid)
        return r.known(r.computed, r.token_base + len(r.tokens))

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
        request, published pages never free, history bounded by what later steps need."""
        self.pool.check()
        expected = [0] * self.pool.num_pages
        for r in self.requests.values():
            assert len(set(r.pages)) == len(r.pages), f"request {r.rid!r} holds a page twice"
            assert r.first_page * self.page_size <= r.computed <= (r.first_page + len(r.pages)) * self.page_size
            assert r.token_base <= r.computed <= r.token_base + len(r.tokens)
            for page in r.pages:
                expected[page] += 1
        assert expected == self.pool.ref_count, "ref counts differ from the page tables"
        for page in self.index.by_page:
            assert self.pool.ref_count[page] > 0 or page in self.pool.cached, f"cached page {page} is free"
