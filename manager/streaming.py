"""StreamingLLM's policy (attention sinks plus the most recent tokens within a page budget) and the
decision of how much a step discards."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class StreamingPolicy:
    """StreamingLLM: keep ``sinks`` first tokens (rounded up to whole pages) plus the most recent ones
    within ``budget_pages`` pages per request. When a step would exceed the budget, at least half of the
    pages after the sinks (and at least what the step needs) are dropped (a caller that feeds at most
    :func:`streaming_room` tokens per step gets exactly half, at the same points of the stream however it
    chunks its steps) — the positions they held, which
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


def check_policy(streaming) -> None:
    """``TypeError`` unless ``streaming`` is None or a :class:`StreamingPolicy` (a tuple of its fields is not)."""
    if streaming is not None and not isinstance(streaming, StreamingPolicy):
        raise TypeError(f"streaming must be a StreamingPolicy(sinks, budget_pages, mode), "
                        f"got {type(streaming).__name__}")


def streaming_discard(policy: StreamingPolicy, sink_pages: int, page_size: int, rid, computed: int, held: int,
                      n_new: int) -> tuple:
    """(pages after the sinks to drop, positions they hold) before feeding ``n_new`` tokens to request
    ``rid`` that has ``computed`` positions in ``held`` pages; (0, 0) when the step fits. The last page
    may be partly filled, so the positions dropped are counted, not assumed to be whole pages.
    ``ValueError`` when even dropping every page after the sinks does not make room."""
    ps, budget = page_size, policy.budget_pages
    if -(-(computed + n_new) // ps) <= budget:
        return 0, 0
    recent = held - sink_pages
    discard = max(-(-(computed + n_new) // ps) - budget, (recent + 1) // 2)
    dropped = min(discard * ps, computed - sink_pages * ps)
    if recent <= 0 or discard > recent or -(-(computed - dropped + n_new) // ps) > budget:
        raise ValueError(f"request {rid!r}: {n_new} new tokens do not fit the streaming budget of "
                         f"{budget} pages even after dropping every page after the sinks")
    return discard, dropped


def streaming_room(policy: StreamingPolicy, sink_pages: int, page_size: int, computed: int) -> int:
    """The most tokens one step may feed to a request with ``computed`` positions so that its discards happen
    at fixed points of its token stream: a step never crosses the full budget (it stops exactly there), and
    a step from a full cache feeds at most what the standard discard frees ((pages after the sinks + 1) // 2
    pages). How much a step discards depends on the pages held and the tokens fed when it crosses the budget;
    under this rule every discard starts from a full cache with at most that many tokens, so the cache a
    request holds is a function of its tokens alone, however its steps were chunked (and a recomputation
    after preemption rebuilds it exactly)."""
    full = policy.budget_pages * page_size
    if computed < full:
        return full - computed
    return (policy.budget_pages - sink_pages + 1) // 2 * page_size
