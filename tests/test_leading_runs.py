"""Hostile traffic against prompts' last chunks leading decode steps (``schedule(feeds, steps)``,
``commit(plan, tokens)``), the engine's leading greedy runs, and the lock-free token hand-over of ``RequestHandle``.

The manager part drives twin managers through many rounds of random traffic: one plans each step that ends prompts
together with the decode steps after it (``schedule(feeds, steps)`` + ``advance``/``commit(plan, tokens)``), the
other plans the same first step alone and then one ``schedule_decode`` per step. After every round both must hold
the same positions, page counts and published chains (equal hashes), every request exactly the pages its positions
need (no page of a step that did not run), every stored token equal to what was fed (token list or tail buffer), and
a late request must hit the same prefix on both. A model of the cache (``CacheOracle``) checks that every key a step
reads and every prefix hit was written with the reader's own context. The engine part compares ``decode_steps`` > 1
with one step at a time (tokens, counts, the step trace) and with transformers, and streams led runs to many readers.
"""

import asyncio
import threading
import time

import numpy as np
import pytest

from kvcache_op.manager import KVCacheManager, OutOfPages, keyed_page_hash
from manager_checks import assert_stores_are_private, manager_state

PS = 4
PLAN_ARRAYS = ("seqstarts", "kvstarts", "start_pos", "max_seqlen", "max_kvlen", "query_positions", "key_positions",
               "input_ids")


def stored(m, rid) -> dict:
    """position -> token id of what the manager holds for ``rid``: its token list up to where it ends, then its
    tail buffer up to the stored positions."""
    r, R = m.requests[rid], m.rows
    row = r.row
    computed, known_end = int(R.computed[row]), int(R.known_end[row])
    out = {p: r.tokens[p - r.token_base] for p in range(r.token_base, known_end)}
    for p in range(known_end, computed):
        out[p] = int(R.tail[row, p % m.page_size])
    return out


def weak(parent, tokens, identity) -> bytes:
    """A page hash that collides often (pages of other content then close a request's chain)."""
    return bytes([sum(tokens) % 5])


class CacheOracle:
    """A model of the cache: the slot of every position a step that ran stored holds what that position's key
    depends on (the request's tenant and its context up to it). Every key a step reads, and every prefix hit, must
    hold the reader's own."""

    def __init__(self, m):
        self.m, self.slots = m, {}

    def _slot(self, cachestarts_row, p: int) -> int:
        start = int(cachestarts_row[p // self.m.page_size])
        assert start >= 0 and start % self.m.page_size == 0, f"position {p} has no page"
        return start + p % self.m.page_size

    def ran(self, plan, truth: dict, salts: dict) -> None:
        for b, rid in enumerate(plan.request_ids):
            lo, hi = int(plan.seqstarts[b]), int(plan.seqstarts[b + 1])
            positions = plan.query_positions[lo:hi].tolist()
            fed = plan.input_ids[lo:hi].tolist()
            context = truth[rid]
            assert fed == context[positions[0]:positions[-1] + 1], (rid, positions)
            row = plan.cachestarts[b]
            for p in range(positions[0]):  # keys read (no window: every earlier position)
                key = self.slots.get(self._slot(row, p))
                assert key == (salts[rid], tuple(context[:p + 1])), f"request {rid!r} reads a wrong key at {p}"
            for p in positions:
                self.slots[self._slot(row, p)] = (salts[rid], tuple(context[:p + 1]))

    def hit(self, rid, hits: int, context: list, salt) -> None:
        table = self.m.page_table(rid)
        for p in range(hits):
            slot = table[p // self.m.page_size] * self.m.page_size + p % self.m.page_size
            assert self.slots.get(slot) == (salt, tuple(context[:p + 1])), f"{rid!r} hit an unwritten key at {p}"


class Twins:
    """Two managers fed the same traffic; ``truth[rid]``: every token of the request's context (prompt, then what
    was fed after it)."""

    def __init__(self, seed: int, num_pages: int = 400, max_pages: int = 24, weak_hash: bool = False):
        self.rng = np.random.default_rng(seed)
        hash_fn = weak if weak_hash else keyed_page_hash(b"attack" * 4)
        self.a, self.b = (KVCacheManager(num_pages, PS, max_pages, hash_fn=hash_fn) for _ in range(2))
        self.truth, self.salts, self.next_rid = {}, {}, 0
        self.max_pages = max_pages
        self.shared = self.rng.integers(0, 60, 3 * PS).tolist()  # a common prefix many prompts start with
        self.oracles = (CacheOracle(self.a), CacheOracle(self.b))

    # ---- traffic ----------------------------------------------------------------------------------------------
    def prompt(self) -> list:
        rng = self.rng
        kind = rng.integers(0, 4)
        n = int(rng.integers(1, 3 * PS + 2))
        if kind == 0:  # exactly on a page boundary
            n = PS * int(rng.integers(1, 4))
        body = rng.integers(0, 60, n).tolist()
        if kind == 1 and self.truth:  # another request's context so far, and more: a prefix hit of whole pages
            other = self.truth[list(self.truth)[int(rng.integers(0, len(self.truth)))]]
            return list(other[:int(rng.integers(1, len(other) + 1))]) + body[:int(rng.integers(1, PS + 1))]
        if kind == 2:
            return self.shared[:int(rng.integers(PS, len(self.shared) + 1))] + body
        return body

    def add(self, prompt=None, salt=None):
        rid = self.next_rid
        self.next_rid += 1
        prompt = self.prompt() if prompt is None else prompt
        if len(prompt) + 3 * PS + 4 > self.max_pages * PS:
            prompt = prompt[:PS]
        hits = [m.add_request(rid, prompt, salt) for m in (self.a, self.b)]
        assert hits[0] == hits[1], (hits, prompt)
        for oracle, hit in zip(self.oracles, hits):
            oracle.hit(rid, hit, prompt, salt)
        self.truth[rid], self.salts[rid] = list(prompt), salt
        return rid

    def finish(self, rid):
        for m in (self.a, self.b):
            m.finish(rid)
        del self.truth[rid], self.salts[rid]

    def recompute(self, rid):
        """Preempted: released and admitted again with its whole context (generated tokens included)."""
        context, salt = self.truth[rid], self.salts[rid]
        for m in (self.a, self.b):
            m.finish(rid)
        hits = [m.add_request(rid, context, salt) for m in (self.a, self.b)]
        assert hits[0] == hits[1]
        for oracle, hit in zip(self.oracles, hits):
            oracle.hit(rid, hit, context, salt)

    def chunk(self, rid, n):
        """One step of ``rid``'s next ``n`` prompt tokens on both, alone."""
        pending = self.a.pending_tokens(rid)
        assert pending == self.b.pending_tokens(rid)
        for m, oracle in zip((self.a, self.b), self.oracles):
            plan = m.schedule({rid: pending[:n]})
            oracle.ran(plan, self.truth, self.salts)
            m.commit(plan)

    def feeds(self, rids) -> dict:
        """Each request's last chunk (its pending tokens), or one new token after its context."""
        out = {}
        for rid in rids:
            pending = self.a.pending_tokens(rid)
            if pending:
                out[rid] = list(pending)
            else:
                token = int(self.rng.integers(0, 60))
                out[rid] = [token]
        return out

    # ---- checks -----------------------------------------------------------------------------------------------
    def compare(self):
        a, b = self.a, self.b
        assert set(a.index.by_hash) == set(b.index.by_hash)
        for rid in self.truth:
            ca = a.computed(rid)
            assert ca == b.computed(rid), rid
            assert len(a.page_table(rid)) == len(b.page_table(rid)) == -(-ca // PS), rid  # no page of an unrun step
            assert a.requests[rid].registered == b.requests[rid].registered, rid
            assert a.pending_tokens(rid) == b.pending_tokens(rid), rid
            for m in (a, b):
                for p, t in stored(m, rid).items():
                    assert t == self.truth[rid][p], (rid, p)
        # (pages in use are not compared: where two requests fill pages of equal content in one run, the run publishes
        # them in batch order and one step at a time in step order, so the other page is the one shared later; check()
        # asserts that every page held is in a page table and the rest are free or cached)
        a.check()
        b.check()

    def late_hits(self):
        """A request continuing each request's stored context hits the same prefix on both, every full page."""
        for rid in list(self.truth)[:3]:
            context = self.truth[rid][:self.a.computed(rid)] + [7]
            if -(-len(context) // PS) > self.max_pages:
                continue
            hits = []
            for m, oracle in zip((self.a, self.b), self.oracles):
                hits.append(m.add_request("late", context, self.salts[rid]))
                oracle.hit("late", hits[-1], context, self.salts[rid])
                m.finish("late")
            assert hits[0] == hits[1], (rid, hits)
            if self.a.requests[rid].chain_open:
                assert hits[0] == (len(context) - 1) // PS * PS, (rid, hits, len(context))

    # ---- one round: a step ending prompts, then decode steps ---------------------------------------------------
    def ran_as_twin(self, plan, twin, j: int) -> None:
        """Step ``j`` of a led run (``plan``) against the twin's plan of the same step, which then commits: the same
        arrays and fed tokens, stores only into private pages, and (both cache models) keys read as written."""
        for name in PLAN_ARRAYS:
            assert np.array_equal(getattr(plan, name), getattr(twin, name)), (j, name)
        assert plan.fed_tokens == twin.fed_tokens
        assert_stores_are_private(self.a, plan, PS)
        self.oracles[0].ran(plan, self.truth, self.salts)
        self.oracles[1].ran(twin, self.truth, self.salts)
        self.b.commit(twin)

    def lead(self, rids, steps, ran, mode):
        """``rids`` fed their last chunks (or a decode) in a step planned with ``steps - 1`` decode steps after it, of
        which ``ran`` steps run. ``mode``: advanced one step at a time (each), in one advance of all the rows (rows),
        the rows fed to commit (commit), half of each (mixed), or rolled back after they ran (abort)."""
        a, b = self.a, self.b
        feeds = self.feeds(rids)
        tokens = self.rng.integers(0, 60, (steps, len(rids)))  # row j: fed to step j + 1
        before = manager_state(a)
        plan = first = a.schedule(feeds, steps)
        if mode == "abort":
            for j in range(1, ran):
                plan = a.advance(plan, tokens[j - 1])
            a.abort(plan)
            assert manager_state(a) == before
            a.check()
            return
        for rid, fed in feeds.items():  # the context gets the tokens fed past it
            known = len(self.truth[rid]) - a.computed(rid) + len(fed)
            self.truth[rid] += fed[known:]
        self.ran_as_twin(first, b.schedule(feeds), 0)
        if mode == "rows" and ran > 1:
            last = a.advance(plan, tokens[:ran - 1])
        split = (ran + 1) // 2  # "mixed": the first steps advanced one at a time, the rest fed to commit
        advanced = first
        for j in range(1, ran):
            for i, rid in enumerate(rids):
                self.truth[rid].append(int(tokens[j - 1][i]))
            if mode == "each" or mode == "mixed" and j < split:
                plan = advanced = a.advance(plan, tokens[j - 1])
            else:  # the plan of step j as the caller's own loop builds it
                plan = first.next_decode(tokens[j - 1], steps - 1, later=j)
            self.ran_as_twin(plan, b.schedule_decode(list(rids), tokens[j - 1]), j)
        if mode == "rows" and ran > 1:
            a.commit(last)
        elif mode == "commit":
            a.commit(first, tokens[:ran - 1] if ran > 1 else None)
        elif mode == "mixed" and ran > split:
            a.commit(advanced, tokens[split - 1:ran - 1])
        else:
            a.commit(plan)


def run_rounds(seed: int, rounds: int, longest: int, num_pages: int = 400):
    t = Twins(seed, num_pages=num_pages)
    rng = t.rng
    for _ in range(4):
        t.add(salt=[None, "x"][int(rng.integers(0, 2))])
    for round_ in range(rounds):
        # new requests, some recomputed ones, some prompts partly computed already
        for _ in range(int(rng.integers(0, 3))):
            t.add(salt=[None, "x", b"x"][int(rng.integers(0, 3))])
        for rid in list(t.truth):
            if rng.random() < 0.15 and not t.a.pending_tokens(rid) and len(t.truth[rid]) > 1:
                t.recompute(rid)
            pending = t.a.pending_tokens(rid)
            if len(pending) > 1 and rng.random() < 0.4:
                t.chunk(rid, int(rng.integers(1, len(pending))))
        rids = [rid for rid in t.truth if rng.random() < 0.85] or list(t.truth)[:1]
        rng.shuffle(rids)
        steps = int(rng.integers(2, longest + 1))
        ran = int(rng.integers(1, steps + 1))
        mode = ["each", "rows", "commit", "mixed", "abort"][int(rng.integers(0, 5))]
        t.lead(rids, steps, ran, mode)
        t.compare()
        if round_ % 3 == 2:
            t.late_hits()
            t.compare()
        for rid in list(t.truth):  # requests leave (their pages cached), long ones more likely
            if rng.random() < 0.1 or len(t.truth[rid]) + 3 * PS + 8 > t.max_pages * PS:
                t.finish(rid)
    return t


@pytest.mark.parametrize("longest", [PS, 3 * PS + 1])
@pytest.mark.parametrize("seed", range(8))
def test_leading_runs_leave_what_one_step_at_a_time_leaves_over_many_rounds(seed, longest):
    """Rounds of new requests (prompts on page boundaries, prefix hits of whole pages, salts), preempted requests
    recomputed from their contexts, prompts partly chunked, then a step ending them with runs of up to a page
    (``longest`` 4) or three pages of decode steps, stopped after any step, committed in every way or aborted."""
    run_rounds(seed, 12, longest)


def run_tight(seed: int, rounds: int, num_pages: int, weak_hash: bool = False):
    """One manager in a pool that runs short (cached pages evicted, runs out of pages): a step ending prompts is
    planned with up to three pages of decode steps, alone when the pages run short, and the newest request is
    preempted (and recomputed later from its context) when even that does not fit. Every key read and every prefix
    hit holds the reader's own context; no page of a step that did not run is kept."""
    t = Twins(seed, num_pages=num_pages, max_pages=12, weak_hash=weak_hash)
    m, oracle, rng = t.a, t.oracles[0], t.rng
    waiting = []
    for _ in range(rounds):
        for _ in range(int(rng.integers(0, 3))):
            prompt = t.prompt()[:2 * PS + 3]
            waiting.append((t.next_rid, prompt, [None, "x"][int(rng.integers(0, 2))]))
            t.next_rid += 1
        while waiting and len(m.requests) < 5 and m.pool.available() > 3 * PS:
            rid, context, salt = waiting.pop(0)
            hits = m.add_request(rid, context, salt)
            oracle.hit(rid, hits, context, salt)
            t.truth[rid], t.salts[rid] = list(context), salt
        rids = list(t.truth)
        if not rids:
            continue
        steps = int(rng.integers(2, 3 * PS + 2))
        feeds = t.feeds(rids)
        while True:
            before = manager_state(m)
            try:
                plan = m.schedule(feeds, steps)
                break
            except OutOfPages:
                assert manager_state(m) == before
                if steps > 1:
                    steps = 1
                    continue
                rid = rids.pop()  # preempted: recomputed later from its context
                m.finish(rid)
                waiting.insert(0, (rid, t.truth.pop(rid), t.salts.pop(rid)))
                feeds.pop(rid)
                if not rids:
                    plan = None
                    break
        if plan is None:
            continue
        for rid, fed in feeds.items():
            known = len(t.truth[rid]) - m.computed(rid) + len(fed)
            t.truth[rid] += fed[known:]
        oracle.ran(plan, t.truth, t.salts)
        ran = int(rng.integers(1, steps + 1))
        tokens = rng.integers(0, 60, (max(ran - 1, 1), len(rids)))
        first = plan
        for j in range(1, ran):
            for i, rid in enumerate(rids):
                t.truth[rid].append(int(tokens[j - 1][i]))
            plan = first.next_decode(tokens[j - 1], steps - 1, later=j)
            oracle.ran(plan, t.truth, t.salts)
        m.commit(first, tokens[:ran - 1] if ran > 1 else None)
        m.check()
        for rid in rids:
            assert len(m.page_table(rid)) == -(-m.computed(rid) // PS)
            for p, token in stored(m, rid).items():
                assert token == t.truth[rid][p]
            if rng.random() < 0.2 or len(t.truth[rid]) + 3 * PS + 4 > 12 * PS:
                m.finish(rid)
                del t.truth[rid], t.salts[rid]
    assert m.pool.evictions > 0 or weak_hash  # the pool did run short (fewer pages are cached under a weak hash)


@pytest.mark.parametrize("weak_hash", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_leading_runs_in_a_tight_pool_never_read_or_share_an_unwritten_key(seed, weak_hash):
    """(A weak page hash: colliding pages close chains, and every hit must still be the reader's own keys.)"""
    run_tight(seed, 40, num_pages=24, weak_hash=weak_hash)


# ---- the engine ---------------------------------------------------------------------------------------------------

def engine_run(steps: int, prompts, new_tokens: int, *, params=None, arrivals=None, salts=None, **settings):
    """(tokens, (steps, fed tokens, generated tokens, preemptions), how many runs a prompt's last chunk led, each
    step's traced (sequences, decodes, tokens, keys))."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.serving import Engine

    engine = Engine(hf_models.exported("llama"), decode_steps=steps, trace_steps=True, **settings)
    stepper, led = engine.runner.greedy_steps(), []
    start = stepper.start

    def spied(feeds, leading=None):
        led.append(leading is not None)
        return start(feeds, leading)

    stepper.start = spied
    tokens = engine.generate(prompts, new_tokens, params=params, arrival_steps=arrivals, salts=salts)
    m = engine.metrics()
    engine.manager.check()
    assert not engine.manager.requests and m["pages_in_use"] == 0
    engine.close(timeout=60)
    trace = [(t["sequences"], t["decodes"], t["tokens"], t["kv_tokens"]) for t in engine.step_trace]
    assert len(trace) == m["steps"]
    return tokens, (m["steps"], m["fed_tokens"], m["generated_tokens"], m["preemptions"]), sum(led), trace


def page_size() -> int:
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.serving import Engine

    return Engine(hf_models.exported("llama"), num_pages=4, decode_steps=1).info.page_size


def boundary_prompts(count: int, seed: int) -> list:
    """Prompts ending on a page boundary, one token before and after it, short ones, and ones sharing whole pages."""
    ps, rng = page_size(), np.random.default_rng(seed)
    shared = rng.integers(0, 384, 2 * ps).tolist()
    lengths = [ps, 2 * ps, ps - 1, ps + 1, 3, 2 * ps + 1, 1]
    prompts = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        prompts.append(shared[:n] if i % 3 == 1 else rng.integers(0, 384, n).tolist())
    return prompts


@pytest.mark.parametrize("settings", [
    dict(num_pages=40, max_batch_tokens=7, max_running=3),  # chunked prompts, slots queue, page-boundary prompts
    dict(num_pages=40, max_batch_tokens=64, max_running=8),  # whole prompts end together
    dict(num_pages=7, max_batch_tokens=12, max_running=4),  # a tight pool: runs fall back, requests are preempted
])
def test_led_runs_give_the_tokens_and_counts_of_one_step_at_a_time(settings):
    """Prompts ending on page boundaries (and prefix hits of whole pages) in chunks, their last chunks leading runs of
    greedy decode steps that cross pages: the tokens of one step at a time and of transformers, and the same steps,
    fed and generated tokens (and preemptions)."""
    prompts = boundary_prompts(9, 1)
    arrivals = [0, 0, 0, 3, 3, 9, 20, 21, 40]
    new = 22
    one = engine_run(1, prompts, new, arrivals=arrivals, **settings)
    many = engine_run(9, prompts, new, arrivals=arrivals, **settings)
    assert many[0] == one[0]
    assert many[1] == one[1], (one[1], many[1])
    assert many[2] > 0 and one[2] == 0
    assert many[3] == one[3]  # step by step: the same sequences, decodes, fed tokens and keys
    import hf_models
    from kvcache_op.hf.verify import reference_generate

    model = hf_models.model("llama")
    for prompt, tokens in zip(prompts, many[0]):
        assert tokens == reference_generate(model, prompt, new)


def test_led_runs_ending_on_their_first_token_or_mid_run_give_one_step_tokens():
    """Stop ids that end requests on the token their prompt's last chunk chose (the leading step's own), and in the
    middle of a led run: the tokens, steps and fed tokens of one step at a time."""
    prompts = boundary_prompts(8, 2)
    settings = dict(num_pages=40, max_batch_tokens=9, max_running=4)
    arrivals = [0, 0, 1, 1, 5, 6, 14, 30]
    plain = engine_run(1, prompts, 12, arrivals=arrivals, **settings)
    plain = plain[0]
    stops = (plain[0][0], plain[3][0], plain[5][4])  # first tokens (led steps' own), and a token mid-run
    from kvcache_op.serving import SamplingParams

    params = SamplingParams(stop_token_ids=stops)  # (generate gives every request max_new_tokens)
    one = engine_run(1, prompts, 12, params=params, arrivals=arrivals, **settings)
    many = engine_run(7, prompts, 12, params=params, arrivals=arrivals, **settings)
    assert many[0] == one[0] and many[1] == one[1] and many[3] == one[3], (one[:3], many[:3])
    assert many[2] > 0
    for tokens, full in zip(many[0], plain):  # each is the plain run cut at its first stop
        cut = next((j + 1 for j, t in enumerate(full) if t in stops), len(full))
        assert tokens == full[:cut]
    assert sum(len(tokens) == 1 for tokens in many[0]) >= 2


# ---- the token hand-over without a lock ---------------------------------------------------------------------------

def test_every_pushed_token_wakes_every_thread_and_asyncio_reader_before_the_next_one():
    """A lost wake-up shows only as delay (the next token or the finish wakes the reader again), so the pusher here
    waits after each token until every reader has it, and fails after 5 s: a reader that registered after the push
    looked, or a push that missed a registered reader, would never see the token in time. Each handle has one reader
    (another reader's registration would wake it too), and thread switches are as frequent as Python allows, so
    the two sides interleave at every bytecode."""
    import sys

    from kvcache_op.serving.online import RequestHandle

    threads_count, asyncio_count, tokens = 3, 3, 2000
    handles = [RequestHandle(k) for k in range(threads_count + asyncio_count)]
    seen = [0] * len(handles)
    streams = [[] for _ in handles]

    def thread_reader(k):
        pause = np.random.default_rng(k).random(tokens) * 1e-4
        for token in handles[k]:
            streams[k].append(token)
            seen[k] += 1
            time.sleep(pause[token])  # the next push comes while this reader is on its way back: it may look at
            # any point of the reader's registration

    async def async_reader(k):
        pause = np.random.default_rng(k).random(tokens) * 1e-4
        async for token in handles[k]:
            streams[k].append(token)
            seen[k] += 1
            time.sleep(pause[token])

    def loop_thread():
        async def main():
            readers = [async_reader(threads_count + k) for k in range(asyncio_count)]
            await asyncio.wait_for(asyncio.gather(*readers), 120)
        asyncio.run(main())

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    workers = [threading.Thread(target=thread_reader, args=(k,), daemon=True) for k in range(threads_count)]
    workers.append(threading.Thread(target=loop_thread, daemon=True))
    try:
        for w in workers:
            w.start()
        rng = np.random.default_rng(0)
        for i in range(tokens):
            for handle in handles:
                handle._push(i, None, time.perf_counter())
            if rng.random() < 0.2:  # now and then a burst: the readers catch up later
                continue
            deadline = time.monotonic() + 5
            while min(seen) < i + 1:
                assert time.monotonic() < deadline, f"token {i}: readers saw {seen} (a lost wake-up)"
                time.sleep(0)
        for handle in handles:
            handle._finish("length")
        for w in workers:
            w.join(timeout=30)
    finally:
        sys.setswitchinterval(switch)
    assert not any(w.is_alive() for w in workers)
    assert all(stream == list(range(tokens)) for stream in streams)
    assert all(len(handle.token_times) == tokens for handle in handles)


def test_streams_of_led_runs_from_many_threads_and_event_loops_with_cancels_agree_with_lone_runs():
    """Submitters on several threads (their prompts chunked, so last chunks lead runs of up to 30 greedy steps),
    each request read by a thread iterator and an ``async for`` at once, some cancelled mid-stream, ``metrics()``
    read while runs go: every stream is its handle's result, a finished request equals its lone run, a cancelled one
    a prefix of it, nothing hangs (timeouts), and every page comes back."""
    pytest.importorskip("torch")  # kvcache_op.hf imports it
    pytest.importorskip("transformers")
    import hf_models
    from kvcache_op.serving import Engine, SamplingParams

    path, rng = hf_models.exported("llama"), np.random.default_rng(5)
    prompts = boundary_prompts(7, 3)
    lengths = [1, 2, 5, 17, 33, 40, 3]
    lone_engine = Engine(path, num_pages=40, decode_steps=1)
    lone = {(i, n): lone_engine.generate([prompts[i]], n)[0] for i in range(len(prompts)) for n in set(lengths)}
    engine = Engine(path, num_pages=20, max_running=5, max_batch_tokens=10, decode_steps=30)
    led, start = [], engine.runner.greedy_steps().start

    def spied(feeds, leading=None):
        led.append(leading is not None)
        return start(feeds, leading)

    engine.runner.greedy_steps().start = spied
    # A request alone is fed whole each step and nothing waits: its last chunk leads a run whatever the threads'
    # timing below.
    alone = engine.submit(prompts[0], SamplingParams(max_tokens=17))
    assert alone.result(timeout=60) == lone[0, 17] and any(led), led
    outcomes, errors, lock = [], [], threading.Lock()

    def consume_async(handle, box):
        async def read():
            return [token async for token in handle]

        box.append(asyncio.run(asyncio.wait_for(read(), 120)))

    def client(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(4):
                i, n = int(r.integers(0, len(prompts))), lengths[int(r.integers(0, len(lengths)))]
                handle = engine.submit(prompts[i], SamplingParams(max_tokens=n))
                box = []
                reader = threading.Thread(target=consume_async, args=(handle, box), daemon=True)
                reader.start()
                cancel_at = int(r.integers(1, n + 1)) if r.random() < 0.3 else None
                streamed = []
                for token in handle:
                    streamed.append(token)
                    if cancel_at is not None and len(streamed) == cancel_at:
                        handle.cancel()
                    if r.random() < 0.05:
                        engine.metrics()
                reader.join(timeout=120)
                assert not reader.is_alive(), "an async reader hung"
                with lock:
                    outcomes.append((i, n, handle.finish_reason, streamed, box[0], handle.result(timeout=60)))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(seed,), daemon=True) for seed in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors
    assert len(outcomes) == 20
    for i, n, reason, streamed, async_streamed, result in outcomes:
        assert streamed == async_streamed == result
        if reason == "cancelled":
            assert result == lone[i, n][:len(result)]
        else:
            assert reason == "length" and result == lone[i, n], (i, n)
    engine.close(timeout=60)
    engine.manager.check()
    assert engine.metrics()["pages_in_use"] == 0 and not engine.manager.requests


def test_refused_leading_steps_and_commits_change_nothing():
    """Every refusal of ``schedule(feeds, steps)`` (bad steps, a window or StreamingLLM, a prompt left after the step,
    a decoding request or a prompt passing max_pages with the steps, too few pages) and of ``commit(plan, tokens)``
    (bad rows, too many, a plan that is not the outstanding one) leaves the manager as it was; the outstanding step
    then still commits the steps that ran."""
    from kvcache_op.manager import StreamingPolicy

    def fresh(**kwargs):
        m = KVCacheManager(kwargs.pop("num_pages", 40), PS, kwargs.pop("max_pages", 4), **kwargs)
        m.add_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # decoding, near the end of its page table
        m.commit(m.schedule({"d": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}))
        m.add_request("p", [20, 21, 22, 23, 24, 25])  # a prompt, its first chunk computed
        m.commit(m.schedule({"p": [20, 21]}))
        return m

    feeds = {"d": [11], "p": [22, 23, 24, 25]}
    cases = [
        (fresh(), feeds, 0, ValueError, "steps must be in"),
        (fresh(), feeds, PS * 4 + 1, ValueError, "steps must be in"),
        (fresh(), feeds, True, TypeError, "steps"),
        (fresh(), feeds, 2.0, TypeError, "steps"),
        (fresh(sliding_window=5), feeds, 2, ValueError, "sliding window"),
        (fresh(streaming=StreamingPolicy(1, 3), max_pages=4), feeds, 2, ValueError, "StreamingLLM"),
        (fresh(), {"d": [11], "p": [22, 23]}, 2, ValueError, "'p' has prompt tokens to feed after this step"),
        (fresh(), feeds, 7, ValueError, "'d': 7 decode steps need more than max_pages"),  # d: positions 10..16
        (fresh(max_pages=3), {"p": [22, 23, 24, 25]}, 8, ValueError, "'p': 4 pages exceed max_pages=3"),
        (fresh(num_pages=5), feeds, 6, OutOfPages, None),  # 3 + 2 pages held; d needs 1 more, p 1 more
    ]
    for m, fed, steps, error, match in cases:
        before = manager_state(m)
        with pytest.raises(error, match=match):
            m.schedule(fed, steps)
        assert manager_state(m) == before, (steps, match)
        m.check()
        m.commit(m.schedule(fed))  # as one step it is fine (d and p both take a page: the tight pool has two)

    m = fresh(num_pages=40, max_pages=8)
    plan = m.schedule(feeds, 5)
    before = manager_state(m)
    for bad, error in (([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], ValueError),  # 5 rows: 4 steps are left
                       ([[1, 2, 3]], ValueError), ([[1, -2]], ValueError), (np.zeros((1, 2)), TypeError),
                       ([1], ValueError)):
        with pytest.raises(error):
            m.commit(plan, bad)
        assert manager_state(m) == before
    with pytest.raises(ValueError, match="not the outstanding step"):
        m.commit(plan.decode_base, [[1, 2]])  # the base is not the plan the manager gave
    assert manager_state(m) == before
    m.commit(plan, [[30, 31], [32, 33]])  # three steps ran
    assert m.computed("d") == 13 and m.computed("p") == 8
    assert m.page_table("d") and len(m.page_table("d")) == 4 and len(m.page_table("p")) == 2
    m.check()
    assert m.add_request("late p", [20, 21, 22, 23, 24, 25, 31, 33, 99]) == 8  # both pages, with the steps' tokens
    assert m.add_request("late d", list(range(1, 11)) + [11, 30, 99]) == 12  # its third page: 9, 10, 11, 30
    assert m.add_request("not written", [20, 21, 22, 23, 24, 25, 31, 33, 40, 41, 42, 43, 44]) == 8
    m.check()
