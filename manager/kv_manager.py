"""Host-side paged KV-cache manager: page tables, prefix caching, sliding window; it produces exactly
the KeyValueCache op's index inputs (cache_mode 1) for each scheduler step.

Contract with the caller: ``add_request`` admits a prompt (reusing the longest cached prefix of
full pages); each ``schedule`` call returns a :class:`StepPlan` whose op inputs the caller runs
through the op *before* the next ``schedule``; ``finish`` releases a request. Pages that become full
in a step are registered for prefix reuse at that step, so the op must run the step it was given.
"""

import dataclasses

import numpy as np

from .errors import OutOfPages, UnknownRequest
from .page_pool import PagePool
from .prefix_index import PrefixIndex, chained_hash


@dataclasses.dataclass
class _Request:
    rid: object
    extra: object  # (salt, cache settings): part of every page's identity
    tokens: list  # every token id known: the prompt, then what was fed
    computed: int = 0  # positions [0, computed) are stored in the cache
    pages: list = dataclasses.field(default_factory=list)  # page id per page index; None once released
    first_page: int = 0  # first retained page index (sliding window releases the ones before)
    chain: list = dataclasses.field(default_factory=list)  # (hash, node) of each registered full page
    chain_open: bool = True  # False once a page could not be registered: no later page can be


@dataclasses.dataclass(frozen=True)
class StreamingPolicy:
    """StreamingLLM: keep ``sinks`` first tokens (rounded up to whole pages) plus the most recent ones
    within ``budget_pages`` pages per request. When a step would exceed the budget, at least half of the
    pages after the sinks (and at least what the step needs) are dropped, then either

    * ``"shift"``: the kept keys are re-rotated to their new positions — the step's plan carries
      ``shift_slots``/``shift_deltas`` for KeyCacheRotaryShift, to run (every layer) before the op; or
    * ``"reevaluate"``: the kept tokens are fed again at their new positions in this step
      (``StepPlan.fed_tokens``), and their old pages are released.

    Positions are cache positions (contiguous after a discard), as StreamingLLM defines them. Prefix
    reuse and registration cover only the sink pages: later pages are shifted or dropped in place, so
    they are never shared.
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


class KVCacheManager:
    """Pages of ``page_size`` slots out of ``num_pages``; page tables up to ``max_pages`` wide.

    ``sliding_window`` (W): a query at position q sees keys (q - W, q]; pages wholly before every
    query's window are released. ``cache_key`` (e.g. the cache's quant settings) joins every page's
    identity, as does a request's ``salt`` (tenant isolation: different salts never share pages).
    """

    def __init__(self, num_pages: int, page_size: int, max_pages: int, *, sliding_window=None, cache_key=(),
                 hash_fn=chained_hash, streaming: StreamingPolicy = None):
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size and max_pages must be >= 1, got {page_size}, {max_pages}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sink_pages = 0
        if streaming is not None:
            self.sink_pages = -(-streaming.sinks // page_size)
            if sliding_window is not None:
                raise ValueError("streaming and sliding_window are alternatives; configure one")
            if streaming.mode not in ("shift", "reevaluate"):
                raise ValueError(f"streaming mode must be 'shift' or 'reevaluate', got {streaming.mode!r}")
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

    # ---- admission ---------------------------------------------------------------------------------
    def add_request(self, rid, prompt, salt=None) -> int:
        """Admits a request; returns how many prompt tokens come from the prefix cache (full pages only,
        and never the last prompt token: a step must compute at least one token to produce logits)."""
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already active")
        prompt = list(map(int, prompt))
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        r = _Request(rid, (salt, self.cache_key), prompt)
        parent_hash, parent_node = None, PrefixIndex.ROOT
        reusable = (len(prompt) - 1) // self.page_size
        if self.streaming is not None:
            reusable = min(reusable, self.sink_pages)  # later pages get shifted or dropped in place
        for j in range(reusable):
            tokens = tuple(prompt[j * self.page_size:(j + 1) * self.page_size])
            h, entry = self.index.lookup(parent_hash, parent_node, tokens, r.extra)
            if entry is None:
                break
            self.pool.acquire(entry.page)
            r.pages.append(entry.page)
            r.chain.append((h, entry.node))
            parent_hash, parent_node = h, entry.node
        r.computed = len(r.pages) * self.page_size
        self.queried_tokens += len(prompt)
        self.hit_tokens += r.computed
        self.requests[rid] = r
        return r.computed

    def finish(self, rid) -> None:
        """Releases a request's pages (registered ones stay cached for reuse until evicted)."""
        r = self._get(rid)
        for page in r.pages[r.first_page:]:
            self.pool.release(page, cached=self.index.is_cached(page))
        del self.requests[rid]

    # ---- steps ---------------------------------------------------------------------------------------
    def schedule(self, feeds: dict) -> StepPlan:
        """Plans one step. ``feeds`` maps request id -> the token ids fed this step (a prefill chunk of
        the prompt, or generated tokens). Raises :class:`OutOfPages` (nothing changed) when the pages
        cannot be had, ``ValueError`` for a step no page table can describe."""
        plans = []
        released, new_pages = [], 0
        for rid, tokens in feeds.items():
            r = self._get(rid)
            tokens = list(map(int, tokens))
            if not tokens:
                raise ValueError(f"request {rid!r}: a step must feed at least one token")
            discard = self._streaming_discard(r, len(tokens))
            dropped = []  # pages a StreamingLLM discard gives back (re-evaluation drops every page after the sinks)
            if discard:
                dropped = r.pages[self.sink_pages:self.sink_pages + discard if self.streaming.mode == "shift" else None]
            known = r.tokens[r.computed:r.computed + len(tokens)]
            if tokens[:len(known)] != known:
                raise ValueError(f"request {rid!r}: fed tokens differ from the prompt at positions {r.computed}..")
            end = r.computed + len(tokens) - discard * self.page_size
            first = r.first_page
            if self.sliding_window is not None:
                first = max(first, max(0, r.computed - self.sliding_window + 1) // self.page_size)
            pages_total = -(-end // self.page_size)
            if pages_total - first > self.max_pages:
                raise ValueError(f"request {rid!r}: {pages_total - first} pages exceed max_pages={self.max_pages}")
            released += dropped + r.pages[r.first_page:first]
            new_pages += pages_total - (len(r.pages) - len(dropped))
            plans.append((r, tokens, end, first, discard))
        freed = sum(1 for p in released if self.pool.ref_count[p] == 1)
        if new_pages > self.pool.available() + freed:
            raise OutOfPages(new_pages, self.pool.available() + freed)
        return self._commit(plans)

    def _commit(self, plans) -> StepPlan:
        seqstarts, kvstarts, start_pos, tables, qpos, kpos = [0], [0], [], [], [], []
        fed, shift_slots, shift_deltas = {}, [], []
        for r, tokens, _, first, discard in plans:  # every release before any allocation: schedule() counted on them
            for j in range(r.first_page, first):
                self.pool.release(r.pages[j], cached=self.index.is_cached(r.pages[j]))
                r.pages[j] = None
            r.first_page = first
            fed[r.rid] = tokens
            if discard:
                slots, delta, refeed = self._discard(r, discard)
                shift_slots.append(slots)
                shift_deltas.append(np.full(len(slots), delta, np.int64))
                fed[r.rid] = refeed + tokens
        for r, _, end, first, _ in plans:
            tokens = fed[r.rid]
            while len(r.pages) * self.page_size < end:
                r.pages.append(self.pool.take())
            offset = first * self.page_size
            seqstarts.append(seqstarts[-1] + len(tokens))
            kvstarts.append(kvstarts[-1] + end - offset)
            start_pos.append(r.computed - offset)
            table = [p * self.page_size for p in r.pages[first:]]
            tables.append(table + [-1] * (self.max_pages - len(table)))
            qpos.append(np.arange(r.computed, end))
            kpos.append(np.arange(offset, end))
            r.tokens[r.computed:end] = tokens
            r.computed = end
            self._register_full_pages(r)
        batch = len(plans)
        lengths = np.diff(seqstarts)
        return StepPlan(
            request_ids=[r.rid for r, *_ in plans],
            seqstarts=np.array(seqstarts, np.int64), kvstarts=np.array(kvstarts, np.int64),
            cachestarts=np.array(tables, np.int64).reshape(batch, self.max_pages),
            start_pos=np.array(start_pos, np.int64),
            max_seqlen=np.array(lengths.max(initial=0), np.int64),
            max_kvlen=np.array(np.diff(kvstarts).max(initial=0), np.int64),
            query_positions=np.concatenate(qpos) if qpos else np.zeros(0, np.int64),
            key_positions=np.concatenate(kpos) if kpos else np.zeros(0, np.int64),
            fed_tokens=fed,
            shift_slots=np.concatenate(shift_slots) if shift_slots else np.zeros(0, np.int64),
            shift_deltas=np.concatenate(shift_deltas) if shift_deltas else np.zeros(0, np.int64),
        )

    # ---- StreamingLLM --------------------------------------------------------------------------------
    def _streaming_discard(self, r: _Request, n_new: int) -> int:
        """Pages after the sinks to drop before feeding ``n_new`` tokens (0: none)."""
        if self.streaming is None:
            return 0
        needed = -(-(r.computed + n_new) // self.page_size)
        if needed <= self.streaming.budget_pages:
            return 0
        recent = len(r.pages) - self.sink_pages
        discard = max(needed - self.streaming.budget_pages, (recent + 1) // 2)
        if recent <= 0 or discard > recent:
            raise ValueError(f"request {r.rid!r}: {n_new} new tokens do not fit the streaming budget of "
                             f"{self.streaming.budget_pages} pages even after dropping every page after the sinks")
        return discard

    def _discard(self, r: _Request, discard: int) -> tuple:
        """Drops ``discard`` pages after the sinks. Returns (slots to shift, delta, tokens to re-feed)."""
        ps, first_kept = self.page_size, self.sink_pages + discard
        delta = -discard * ps
        old_computed = r.computed
        kept_positions = np.arange(first_kept * ps, old_computed)
        del r.tokens[self.sink_pages * ps:first_kept * ps]
        if self.streaming.mode == "shift":
            pages = np.asarray(r.pages, np.int64)
            slots = pages[kept_positions // ps] * ps + kept_positions % ps
            for page in r.pages[self.sink_pages:first_kept]:
                self.pool.release(page, cached=False)
            del r.pages[self.sink_pages:first_kept]
            r.computed = old_computed + delta
            return slots, delta, []
        for page in r.pages[self.sink_pages:]:
            self.pool.release(page, cached=False)
        del r.pages[self.sink_pages:]
        r.computed = self.sink_pages * ps
        return np.zeros(0, np.int64), delta, r.tokens[r.computed:old_computed + delta]

    def _register_full_pages(self, r: _Request) -> None:
        while r.chain_open and (len(r.chain) + 1) * self.page_size <= r.computed:
            if self.streaming is not None and len(r.chain) >= self.sink_pages:
                return  # only sink pages are ever shared under StreamingLLM
            j = len(r.chain)
            if r.pages[j] is None:  # released by the window before it could be registered
                r.chain_open = False
                return
            parent_hash, parent_node = r.chain[-1] if r.chain else (None, PrefixIndex.ROOT)
            tokens = tuple(r.tokens[j * self.page_size:(j + 1) * self.page_size])
            h = self.index.hash_fn(parent_hash, tokens, r.extra)
            entry = self.index.insert(h, r.pages[j], parent_node, tokens, r.extra)
            if entry is None:
                r.chain_open = False
                return
            r.chain.append((h, entry.node))

    # ---- inspection --------------------------------------------------------------------------------
    def _get(self, rid) -> _Request:
        try:
            return self.requests[rid]
        except KeyError:
            raise UnknownRequest(rid) from None

    def page_table(self, rid) -> list:
        """Page ids of a request's retained pages, in position order."""
        r = self._get(rid)
        return r.pages[r.first_page:]

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
        """Asserts the bookkeeping invariants (tests): exact ref counts, no page owned twice by one request."""
        self.pool.check()
        expected = [0] * self.pool.num_pages
        for r in self.requests.values():
            retained = r.pages[r.first_page:]
            assert None not in retained
            assert len(set(retained)) == len(retained), f"request {r.rid!r} holds a page twice"
            for page in retained:
                expected[page] += 1
        assert expected == self.pool.ref_count, "ref counts differ from the page tables"
        for page in self.index.by_page:
            assert self.pool.ref_count[page] > 0 or page in self.pool.cached, f"cached page {page} is free"
