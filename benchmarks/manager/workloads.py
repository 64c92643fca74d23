"""Workloads of the cache-manager benchmark. Each takes the manager class to run, so the same workload
measures this package's manager and another revision's (``load_manager_class``) side by side."""

import importlib.util
import pathlib
import statistics
import sys
import time

import numpy as np


def load_manager_class(folder: pathlib.Path):
    """``KVCacheManager`` of the ``manager`` package under ``folder`` (e.g. another revision's sources,
    ``git archive REV manager | tar -x -C folder``), imported under a private name."""
    init = pathlib.Path(folder) / "manager" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"{init} not found: the baseline folder must hold a 'manager' package")
    name = f"_baseline_manager_{abs(hash(str(init.resolve())))}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].KVCacheManager


def shared_prefix_prompts(requests: int, prompt_len: int, shared: int, families: int, seed: int = 0) -> list:
    """Prompts: one of ``families`` shared prefixes of ``shared`` tokens, then unique tokens."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, shared).tolist() for _ in range(families)]
    return [prefixes[i % families] + rng.integers(0, 32000, prompt_len - shared).tolist() for i in range(requests)]


def match_insert_seconds(manager_class, prompts: list, num_pages: int, page_size: int) -> tuple:
    """(seconds, metrics) to admit, prefill (match + insert + allocation) and finish each request in turn."""
    m = manager_class(num_pages, page_size, max_pages=-(-len(prompts[0]) // page_size))
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        hit = m.add_request(i, prompt)
        m.commit(m.schedule({i: prompt[hit:]}))
        m.finish(i)
    return time.perf_counter() - start, m.metrics()


def decode_batch(manager_class, batch: int, kvlen: int, page_size: int, max_pages: int, stagger: bool,
                 spare_pages: int = 1):
    """A manager holding ``batch`` prefilled requests of ``kvlen`` tokens (plus ``b % page_size`` for
    request b when ``stagger``: their pages then fill on different steps, as in a real batch), with
    room for each to grow to ``max_pages`` pages and ``spare_pages`` more."""
    m = manager_class(batch * max_pages + spare_pages, page_size, max_pages)
    for i in range(batch):
        prompt = [(i * 7919 + t) % 32000 for t in range(kvlen + (i % page_size if stagger else 0))]
        m.add_request(i, prompt)
        m.commit(m.schedule({i: prompt}))
    return m


def decode_step_seconds(manager_class, batch: int, kvlen: int, page_size: int, steps: int, stagger: bool,
                        arrays: bool = False) -> list:
    """(schedule, commit, CPU) seconds of each of ``steps`` decode steps of a ``batch``-request batch,
    planned with ``schedule({rid: [token]})`` or, with ``arrays``, ``schedule_decode(rids, tokens)``.
    CPU: the thread's CPU time for schedule + commit, which leaves out the time the thread waited for a
    core (on a shared machine, wall time also counts other processes)."""
    m = decode_batch(manager_class, batch, kvlen, page_size, -(-(kvlen + page_size + steps + 1) // page_size), stagger)
    rids, times = list(range(batch)), []
    for step in range(steps):
        tokens = (np.arange(batch) + step) % 32000
        feeds = None if arrays else {i: [t] for i, t in enumerate(tokens.tolist())}
        cpu, start = time.thread_time(), time.perf_counter()
        plan = m.schedule_decode(rids, tokens) if arrays else m.schedule(feeds)
        planned = time.perf_counter()
        m.commit(plan)
        end = time.perf_counter()
        times.append((planned - start, end - planned, time.thread_time() - cpu))
    return times


def mixed_step_seconds(manager_class, batch: int, kvlen: int, page_size: int, max_pages: int, prefills: int,
                       prefill_len: int, steps: int) -> float:
    """Median seconds of a mixed step (schedule + commit): ``batch`` requests of ``kvlen`` tokens decode
    one token each while ``prefills`` new requests are fed their whole ``prefill_len``-token prompt.
    The new requests are admitted before and finished after each step (not timed), so every step
    looks the same."""
    m = decode_batch(manager_class, batch, kvlen, page_size, max_pages, stagger=True,
                     spare_pages=prefills * -(-prefill_len // page_size))
    rng = np.random.default_rng(1)
    times = []
    for step in range(steps):
        new = {batch + j: rng.integers(0, 32000, prefill_len).tolist() for j in range(prefills)}
        feeds = {i: [(i + step) % 32000] for i in range(batch)}
        for rid, prompt in new.items():
            feeds[rid] = prompt[m.add_request(rid, prompt):]
        start = time.perf_counter()
        m.commit(m.schedule(feeds))
        times.append(time.perf_counter() - start)
        for rid in new:
            m.finish(rid)
    return statistics.median(times)


def chat_pages_needed(turns: int, user_len: int, reply_len: int, concurrent: int, page_size: int) -> int:
    """The fewest pages :func:`chat_hit_rate` runs with: ``concurrent`` conversations at their longest."""
    return concurrent * _conversation_pages(turns, user_len, reply_len, page_size)


def _conversation_pages(turns: int, user_len: int, reply_len: int, page_size: int) -> int:
    """The pages of a conversation at its longest: a 64-token system prompt and every turn's message and reply."""
    return -(-(64 + turns * (user_len + reply_len)) // page_size)


def chat_hit_rate(manager_class, conversations: int, turns: int, user_len: int, reply_len: int, concurrent: int,
                  num_pages: int, page_size: int, seed: int = 0) -> dict:
    """A multi-turn chat: each turn's prompt is the conversation so far plus a new user message; its
    reply is decoded one token per step alongside the other live conversations; then the request
    finishes and the conversation waits for its next turn. ``concurrent`` conversations are live at a
    time, in a fixed random order, with a pool small enough that cached pages get evicted. Returns the
    manager's metrics (prefix hit rate among them)."""
    rng = np.random.default_rng(seed)
    history = {c: rng.integers(0, 32000, 64).tolist() for c in range(conversations)}  # a system prompt each
    order = [c for _ in range(turns) for c in rng.permutation(conversations).tolist()]
    max_pages = _conversation_pages(turns, user_len, reply_len, page_size)
    if num_pages < concurrent * max_pages:
        raise ValueError(f"{num_pages} pages cannot hold {concurrent} conversations of up to {max_pages} pages")
    m = manager_class(num_pages, page_size, max_pages)
    live, left = {}, {}  # conversation -> request id; request id -> reply tokens still to decode
    next_rid = 0
    while order or live:
        while order and len(live) < concurrent and order[0] not in live:
            c = order.pop(0)
            history[c] += rng.integers(0, 32000, user_len).tolist()
            hit = m.add_request(next_rid, history[c])
            m.commit(m.schedule({next_rid: history[c][hit:]}))
            live[c], left[next_rid] = next_rid, reply_len
            next_rid += 1
        feeds = {}
        for c, rid in live.items():
            token = int(rng.integers(0, 32000))
            feeds[rid] = [token]
            history[c].append(token)
            left[rid] -= 1
        m.commit(m.schedule(feeds))
        for c, rid in list(live.items()):
            if left[rid] == 0:
                m.finish(rid)
                del live[c], left[rid]
        if order and order[0] in live:  # the next turn's conversation is still replying: skip ahead
            order.append(order.pop(0))
    return m.metrics()


def seed_trie_seconds(prompts: list, num_pages: int, page_size: int) -> float:
    """Seconds of the seed's block trie on the match + insert workload (allocate and free each prompt)."""
    from .block_trie_seed import BlockTrie

    trie = BlockTrie(num_pages, page_size)
    start = time.perf_counter()
    for prompt in prompts:
        trie.free(prompt, trie.allocate(prompt))
    return time.perf_counter() - start
