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

This file holds the configuration and the step transactions; each other part of the manager is a file of its
own, mixed into :class:`KVCacheManager`: admission (``admission``), batch lookup (``batch_lookup``), planning
(``step_planner``), applying (``step_applier``), publishing (``prefix_publisher``) and inspection
(``inspection``).
"""

import collections

import numpy as np

from .admission import Admission
from .batch_lookup import BatchLookup
from .errors import OutOfPages, UnknownRequest
from .identity import DEFAULT_VOCAB_SIZE, check_int, check_vocab_size, key_bytes, token_array, token_rows
from .inspection import Inspection
from .page_pool import PagePool
from .prefix_index import PrefixIndex
from .prefix_publisher import PrefixPublisher
from .request_rows import RequestRows
from .step_applier import StepApplier
from .step_plan import StepPlan
from .step_planner import StepPlanner
from .step_records import OutstandingStep, Request
from .streaming import StreamingPolicy, check_policy

__all__ = ["KVCacheManager", "StepPlan", "StreamingPolicy"]


class KVCacheManager(Admission, BatchLookup, StepPlanner, StepApplier, PrefixPublisher, Inspection):
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
        check_policy(streaming)
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
        # Whether the window bounds what a request holds: a decode step's window spans at most
        # ceil((W - 1) / page_size) + 1 pages. A wider window never releases a page within max_pages, so a
        # request is then bounded by max_pages as without one.
        self.window_bounds = sliding_window is not None and -(-(sliding_window - 1) // page_size) + 1 <= max_pages
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

    # ---- steps ---------------------------------------------------------------------------------------
    def schedule(self, feeds: dict, steps: int = 1) -> StepPlan:
        """Plans one step. ``feeds`` maps request id -> the token ids fed this step (a prefill chunk of
        the prompt, or generated tokens). Raises :class:`OutOfPages` when the pages cannot be had,
        ``ValueError``/``TypeError`` for a step no page table can describe, ``RuntimeError`` while an
        earlier step is outstanding — in every case with nothing changed.

        ``steps`` > 1 plans this step and ``steps - 1`` decode steps after it at once, as
        :meth:`schedule_decode` does (same limits), when every request's feed reaches the end of its prompt: a
        prefill's last chunk and the first tokens it generates then cost one transaction. :meth:`advance` goes on
        from the tokens this step chose.

        Cost: a fixed number of numpy operations over the batch, plus Python work per request only
        where the step does more than append one generated token (a prefill chunk, several tokens, a
        window release, a StreamingLLM discard; a new page costs one pool operation) — proportional to
        what changes, not to the requests' context lengths."""
        self._check_idle()
        if not isinstance(feeds, dict):
            raise TypeError(f"feeds must be a dict of request id -> token ids, got {type(feeds).__name__}")
        steps = self._check_steps(steps)
        rids = list(feeds)
        batch = self._batch_of(feeds, rids)
        if batch is None:
            batch = self._check_each(feeds)  # raises the first request's error, in feed order
        return self._schedule(rids, batch, feeds, steps)

    def schedule_decode(self, request_ids, tokens, steps: int = 1) -> StepPlan:
        """Plans a step that feeds one token to each request: ``tokens[i]`` to ``request_ids[i]`` (a list
        or tuple of distinct active ids; ``tokens`` a 1-D integer array or a sequence of ints of the
        same length). Exactly ``schedule({rid: [token], ...})`` — the same plan, the same effect, the
        same errors with nothing changed — without a dict and a list per request, for large decode
        batches.

        ``steps`` > 1 (at most ``page_size * max_pages``; no sliding window or StreamingLLM; requests that only
        decode) plans that many decode steps of the batch at once: the pages of all of them are taken now, the plan is
        the first step's, and :meth:`advance` gives each next one from the tokens the previous one chose, so a
        decode loop pays for planning once every ``steps`` steps. ``commit`` then commits the steps that ran
        (returning the pages taken for those that did not), as that many one-step transactions would leave the
        manager (what it reports and publishes; a crossed page's later tokens may sit in the request's token
        list rather than its tail buffer), except that a request's page for a step that did not run was taken (it goes back free; a cached
        page evicted for it stays evicted, as on ``abort``); ``abort`` rolls all of them back."""
        self._check_idle()
        if not isinstance(request_ids, (list, tuple)):
            raise TypeError(f"request_ids must be a list or tuple, got {type(request_ids).__name__}")
        steps = self._check_steps(steps)
        rids = list(request_ids)
        ids = token_array(tokens, len(rids), self.vocab_size, "schedule_decode: tokens")
        rows = self._rows_of(rids)
        return self._schedule(rids, (rows, None, ids), None, steps)

    def advance(self, plan: StepPlan, tokens) -> StepPlan:
        """The plan of the next of the decode steps ``schedule_decode(..., steps)`` (or ``schedule(feeds, steps)``)
        planned, once ``plan`` (the step before it) ran: ``tokens[i]`` (what that step chose) fed to request ``i``. The same page tables
        (they hold every planned step's pages), each request one position further. ``tokens`` may also be k rows
        (a 2-D integer array or a list of k lists): the plan k steps further, as k calls of one row each would give
        (row j fed to the step after the one row j - 1 was fed to), for a caller that ran the steps without the
        manager. ``ValueError`` with nothing changed for a plan that is not the outstanding one or past the planned
        steps; ``TypeError``/``ValueError`` for bad tokens."""
        step = self._outstanding_step(plan, "advance")
        rows, left = self._fed_rows(step, tokens, "advance")
        # before any change: a failure here leaves the step as it was
        following = plan.next_decode(rows[-1], left, later=len(rows))
        step.fed.append(rows)
        step.fed_steps += len(rows)
        step.plan = following
        return following

    def _fed_rows(self, step: OutstandingStep, tokens, verb: str) -> tuple:
        """(``tokens`` as k checked rows, read-only; how many planned steps were left before them) for ``advance``
        or ``commit``; ``ValueError``/``TypeError`` with nothing changed."""
        if 1 + step.fed_steps >= step.steps:
            raise ValueError(f"{verb}: all {step.steps} planned steps have run: commit(plan)")
        count = len(step.rids)
        if isinstance(tokens, np.ndarray) and tokens.ndim == 2 or \
                isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], (list, tuple, np.ndarray)):
            rows = token_rows(tokens, count, self.vocab_size, f"{verb}: tokens")
        else:
            rows = token_array(tokens, count, self.vocab_size, f"{verb}: tokens")[None]
        left = step.steps - 1 - step.fed_steps
        if len(rows) > left:
            raise ValueError(f"{verb}: {len(rows)} rows of tokens, but only {left} planned steps are left")
        rows.setflags(write=False)
        return rows, left

    def _check_steps(self, steps) -> int:
        """``steps`` of ``schedule``/``schedule_decode``, checked."""
        steps = check_int("steps", steps)
        if steps != 1:
            if not 1 <= steps <= self.page_size * self.max_pages:
                raise ValueError(f"steps must be in [1, page_size * max_pages = {self.page_size * self.max_pages}], "
                                 f"got {steps}")
            if self.sliding_window is not None or self.streaming is not None:
                raise ValueError("decode steps planned at once need a manager without a sliding window or "
                                 "StreamingLLM (their pages move within a step)")
        return steps

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError("the previous step is outstanding: commit(plan) once the op ran it, or abort(plan)")

    def _schedule(self, rids: list, batch: tuple, feeds, steps: int = 1) -> StepPlan:
        """Plans and applies the step of a checked batch (``feeds``: the step as a dict, or None for one
        token each, to name the first bad request when planning fails)."""
        rows, lengths, ids = batch
        before = self.rows.state.take(rows, axis=0)  # also what abort restores
        try:
            planned = self._plan(rids, before, lengths, ids, steps)
        except ValueError:
            self._check_each(feeds if feeds is not None else {rid: [t] for rid, t in zip(rids, ids.tolist())})
            raise
        # A page the step releases as often as it is referenced is free or evictable once the step has run (two
        # requests of a window can release one shared page in the same step).
        releases = collections.Counter(p for w in planned.work for p in w.released)
        freed = sum(1 for p, n in releases.items() if self.pool.ref_count[p] == n)
        if planned.new_pages > self.pool.available() + freed:
            raise OutOfPages(planned.new_pages, self.pool.available() + freed)
        return self._apply(rids, rows, before, lengths, ids, planned)

    def commit(self, plan: StepPlan, tokens=None) -> None:
        """The step of ``plan`` ran (the op stored its keys): its full pages are published for prefix
        reuse and history no longer needed is dropped. Of decode steps planned at once, ``plan`` is the
        last that ran (from :meth:`advance`); or ``tokens`` (rows, as :meth:`advance` takes them) are fed to the
        steps after it that ran too: ``commit(advance(plan, tokens))`` without the last plan's arrays, the same
        errors with nothing changed."""
        step = self._outstanding_step(plan, "commit")
        if tokens is not None:
            rows, _ = self._fed_rows(step, tokens, "commit")
            step.fed.append(rows)
            step.fed_steps += len(rows)
        self._pending = None
        if step.steps > 1:
            self._settle_steps(step)
        self._publish(step)

    @property
    def outstanding_plan(self):
        """The plan :meth:`commit` or :meth:`abort` takes next (of decode steps planned at once, the last that
        :meth:`advance` gave), or None when no step is outstanding."""
        return None if self._pending is None else self._pending.plan

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
        step = self._outstanding_step(plan, verb)
        self._pending = None
        return step

    def _outstanding_step(self, plan: StepPlan, verb: str) -> OutstandingStep:
        step = self._pending
        if step is None or step.plan is not plan:
            raise ValueError(f"{verb}: this plan is not the outstanding step (each plan is committed or "
                             f"aborted once, before the next schedule; of decode steps planned at once, the "
                             f"last that advance gave)")
        return step

    # ---- lookup ------------------------------------------------------------------------------------
    def _get(self, rid) -> Request:
        try:
            return self.requests[rid]
        except KeyError:
            raise UnknownRequest(rid) from None
