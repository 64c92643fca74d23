"""Checks of the cache manager's plans that tests share, written independently of the manager."""

import copy

import numpy as np


def manager_state(m):
    """What a refused or aborted call must leave as it was: the pool, the prefix index, and every
    request's page table, stored positions, pending prompt tokens and remaining bookkeeping."""
    return copy.deepcopy((m.pool.ref_count, list(m.pool.free), list(m.pool.cached), dict(m.index.by_page),
                          {rid: (m.page_table(rid), m.computed(rid), m.pending_tokens(rid), vars(r))
                           for rid, r in m.requests.items()}))


def assert_stores_are_private(m, plan, page_size):
    """Every slot the plan stores into lies in a page that only this request holds and that is not
    published for prefix reuse: a step can never overwrite keys that another request reads."""
    for b, rid in enumerate(plan.request_ids):
        starts = plan.cachestarts[b]
        stored = np.arange(plan.start_pos[b], plan.start_pos[b] + plan.seqstarts[b + 1] - plan.seqstarts[b])
        assert stored.size == 0 or stored[0] >= 0, f"request {rid!r}: negative start_pos {plan.start_pos[b]}"
        for page_index in sorted(set((stored // page_size).tolist())):
            start = int(starts[page_index])
            assert start >= 0 and start % page_size == 0, f"request {rid!r}: page {page_index} has slot {start}"
            page = start // page_size
            assert m.pool.ref_count[page] == 1, f"request {rid!r} stores into page {page}, which others hold too"
            assert not m.index.is_cached(page), f"request {rid!r} stores into published page {page}"


def assert_plan_inputs_agree(plan):
    """The plan's ``input_ids`` are its ``fed_tokens`` in request order (re-evaluated tokens included), and
    ``page_columns`` counts the leading columns of ``cachestarts`` where some request has a page (the rest -1)."""
    flat = [int(t) for rid in plan.request_ids for t in plan.fed_tokens[rid]]
    assert np.asarray(plan.input_ids).dtype == np.int64 and plan.input_ids.tolist() == flat, "input_ids != fed tokens"
    used = 0
    for row in np.asarray(plan.cachestarts).tolist():
        for column, slot in enumerate(row):
            if slot >= 0:
                used = max(used, column + 1)
    assert plan.page_columns == used, f"page_columns {plan.page_columns}, but {used} columns hold pages"
