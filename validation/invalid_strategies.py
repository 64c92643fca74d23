"""Hypothesis strategies for invalid calls of the ops: every named validity row (validation/error_cases.py,
validation/mha_error_cases.py, validation/rotary_cases.py), and valid calls (validation/strategies.py) with one index or
attribute pushed out of range — a slot past the cache, a negative or sentinel page, a start position or a
kvlen beyond what was stored, a launch bound too small, a layer that does not exist, a stored position moved onto a
slot another position stores or loads (always refused by the aliasing rule), a rotary slot listed twice. A mutation
may happen to leave a call valid; whoever uses these asks the reference which it is.
Each strategy yields :class:`~kvcache_op.validation.cases.Case` objects."""

import numpy as np
from hypothesis import strategies as st

from .call_slots import call_slots
from .cases import Case
from .error_cases import INVALID, MORE_INVALID, make_invalid, with_slots_appended
from .mha_error_cases import INVALID as ATTENTION_INVALID
from .mha_error_cases import make_invalid as make_attention_invalid
from .outcome import copies
from .rotary_cases import ERROR_CASES as ROTARY_ERROR_CASES
from .strategies import attention_calls, calls, shift_calls

I64_MAX, I64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min


def _named(rows, make, op_prefix):
    return st.sampled_from(rows).map(lambda row: Case(f"{op_prefix}{row[0]}", *make(row), expect_error=True))


def _set_entry(inputs, name, index, value):
    inputs[name] = inputs[name].copy()
    inputs[name][index] = value


def _partly_used_last_pages(inputs, attrs) -> list:
    """Paged mode: (sequence, page column, slots touched) of each sequence's last touched page when the call
    touches fewer than page_size slots of it."""
    if attrs["cache_mode"] != 1:
        return []
    page_size, found = attrs["page_size"], []
    seqlen = np.diff(inputs["seqstarts"])
    stored = np.where(seqlen > 0, inputs["start_pos"] + seqlen, 0)  # a sequence storing nothing touches no slot
    for b, span in enumerate(np.maximum(stored, np.diff(inputs["kvstarts"]))):
        used = int(span) % page_size
        if span and used:
            found.append((b, int(span) // page_size, used))
    return found


def _aliasing_entries(inputs, attrs) -> list:
    """(cachestarts index, value) pairs that move one position sequence b stores onto a slot another sequence (or,
    paged, b itself through another page) stores or loads, every range or page b touches still inside the cache:
    setting one breaks the aliasing rule and no earlier one."""
    start_pos, seqlen = inputs["start_pos"].tolist(), np.diff(inputs["seqstarts"]).tolist()
    kvlen, page_size = np.diff(inputs["kvstarts"]).tolist(), attrs["page_size"]
    max_t = inputs["cache"].shape[attrs["cache_layout"]]
    store, load = call_slots(inputs["seqstarts"], inputs["kvstarts"], inputs["cachestarts"], inputs["start_pos"],
                             cache_mode=attrs["cache_mode"], page_size=page_size)
    seq, kv = inputs["seqstarts"].tolist(), inputs["kvstarts"].tolist()
    touched = [{**{start_pos[b] + i: int(store[seq[b] + i]) for i in range(seqlen[b])},
                **{t: int(load[kv[b] + t]) for t in range(kvlen[b])}} for b in range(len(seqlen))]
    found = set()
    for b in range(len(seqlen)):
        others = {slot for a, slots in enumerate(touched) if a != b for slot in slots.values()}
        for p in range(start_pos[b], start_pos[b] + seqlen[b]):
            if attrs["cache_mode"] == 0:  # b's whole range moves: it must stay inside (b loads no more than it stores)
                low, high, entry = p, max_t - (start_pos[b] + seqlen[b]) + p, b
                targets = others
            else:  # only p's page moves: it must stay inside
                low, high, entry = p % page_size, max_t - page_size + p % page_size, (b, p // page_size)
                targets = others | {slot for q, slot in touched[b].items() if q // page_size != p // page_size}
            found.update((entry, t - low) for t in targets if low <= t <= high)
    return sorted(found)


@st.composite
def _mutated_kv(draw):
    case = draw(calls())
    inputs, attrs = copies(case.inputs), dict(case.attributes)
    batch = len(inputs["start_pos"])
    max_t = inputs["cache"].shape[attrs["cache_layout"]]
    kinds = ["layer_idx", "max_len", "scale"] + (["cachestarts", "start_pos", "kvstarts"] if batch else [])
    partly_used, aliasing = _partly_used_last_pages(inputs, attrs), _aliasing_entries(inputs, attrs)
    kinds += ["page_past_end"] * bool(partly_used) + ["alias"] * bool(aliasing)
    kind = draw(st.sampled_from(kinds))
    if kind == "page_past_end":  # the touched slots inside the cache and nobody else's, the page's end past it
        b, column, used = draw(st.sampled_from(partly_used))
        _set_entry(inputs, "cachestarts", (b, column), with_slots_appended(inputs, attrs["cache_layout"], used))
    elif kind == "cachestarts":
        table = inputs["cachestarts"]
        index = tuple(draw(st.integers(0, n - 1)) for n in table.shape) if table.size else None
        # max_t - page_size + 1: a page whose first slots are inside and last one past the end (the whole page
        # must be inside)
        bad = draw(st.sampled_from([-1, -attrs["page_size"], max_t - attrs["page_size"] + 1, max_t - 1, max_t,
                                    max_t + 3, I64_MAX, I64_MIN]))
        if index is not None:
            _set_entry(inputs, "cachestarts", index, bad)
    elif kind == "start_pos":
        b = draw(st.integers(0, batch - 1))
        _set_entry(inputs, "start_pos", b, draw(st.sampled_from([-1, max_t, max_t + 7, I64_MAX - 1, I64_MAX])))
    elif kind == "kvstarts":  # sequence b loads more than it stored
        b = draw(st.integers(0, batch - 1))
        stored = int(inputs["start_pos"][b] + inputs["seqstarts"][b + 1] - inputs["seqstarts"][b])
        kv = inputs["kvstarts"] = inputs["kvstarts"].copy()
        kv[b + 1:] += stored + draw(st.integers(1, 3)) - (kv[b + 1] - kv[b])
        # a launch bound that covers it, so the kvlen rule is what the call breaks
        inputs["max_kvlen"] = np.full_like(inputs["max_kvlen"], int(np.diff(kv).max()))
    elif kind == "max_len":
        name = draw(st.sampled_from(["max_seqlen", "max_kvlen"]))
        inputs[name] = inputs[name] - draw(st.integers(1, 3))
    elif kind == "layer_idx":
        attrs["layer_idx"] = attrs["num_layer"] + draw(st.integers(0, 2))
    elif kind == "alias":  # a stored position moved onto a slot another position stores or loads
        _set_entry(inputs, "cachestarts", *draw(st.sampled_from(aliasing)))
    elif attrs["quant_bit"]:
        inputs["scale"] = None if draw(st.booleans()) else inputs["scale"].astype(np.float64)
    else:
        inputs["scale"] = np.ones(3, np.float32)
    return Case("fuzz-invalid", inputs, attrs, expect_error=True)


@st.composite
def _mutated_rotary(draw):
    inputs, attrs = draw(shift_calls())
    inputs = copies(inputs)
    max_t = inputs["cache"].shape[attrs["cache_layout"]]
    kind = draw(st.sampled_from(["slot", "twice", "layer_idx", "rotary_dim"] if len(inputs["slots"]) else ["layer_idx"]))
    if kind == "slot":
        index = draw(st.integers(0, len(inputs["slots"]) - 1))
        _set_entry(inputs, "slots", index, draw(st.sampled_from([-1, max_t, max_t + 5, I64_MAX, I64_MIN])))
    elif kind == "twice":
        _set_entry(inputs, "slots", -1, inputs["slots"][0])
    elif kind == "layer_idx":
        attrs["layer_idx"] = attrs["num_layer"]
    else:
        attrs["rotary_dim"] = draw(st.sampled_from([1, 3, 2 * inputs["cache"].shape[-1] + 2]))
    return Case("fuzz-invalid", inputs, attrs, expect_error=True)


@st.composite
def _mutated_attention(draw):
    case = draw(attention_calls())
    inputs, attrs = copies(case.inputs), dict(case.attributes)
    batch = len(inputs["seqstarts"]) - 1
    kind = draw(st.sampled_from(["kv_total", "decoding", "max_len", "kv_heads"]))
    if kind == "kv_total":
        _set_entry(inputs, "kvstarts", -1, inputs["kvstarts"][-1] + draw(st.sampled_from([1, -1, I64_MAX // 2])))
    elif kind == "decoding":
        inputs["decoding_batches"] = np.full_like(inputs["decoding_batches"], draw(st.sampled_from([-1, batch + 1])))
    elif kind == "max_len":
        name = draw(st.sampled_from(["max_seqlen", "max_kvlen"]))
        inputs[name] = inputs[name] - draw(st.integers(1, 3))
    else:
        attrs["num_kv_heads"] = attrs["num_heads"] + 1
    return Case("fuzz-invalid", inputs, attrs, expect_error=True)


def invalid_kv_calls():
    """Invalid KeyValueCache calls: the named rows, and mutated valid calls."""
    return st.one_of(_named(INVALID + MORE_INVALID, make_invalid, "error_"), _mutated_kv())


def invalid_rotary_calls():
    """Invalid KeyCacheRotaryShift calls: the named rejections, and mutated valid calls."""
    named = st.sampled_from(sorted(ROTARY_ERROR_CASES)).map(
        lambda key: Case(f"rotary_error_{key}", *ROTARY_ERROR_CASES[key](), expect_error=True))
    return st.one_of(named, _mutated_rotary())


def invalid_cache_attention_calls():
    """Invalid MultiHeadCacheAttention calls: every named row (KeyValueCache's rules, then the attention's), and
    mutated valid KeyValueCache calls with a query."""
    from .mhca_cases import error_cases, with_query

    cases = error_cases()

    def with_a_query(case):
        call = with_query(case.name, case.inputs, case.attributes, group=1, is_causal=0)
        return Case(case.name, call.inputs, call.attributes, expect_error=True)

    return st.one_of(st.sampled_from(sorted(cases)).map(lambda name: cases[name]()), _mutated_kv().map(with_a_query))


def invalid_attention_calls():
    """Invalid MultiHeadAttention calls: the named rows, and mutated valid calls."""
    return st.one_of(_named(ATTENTION_INVALID, make_attention_invalid, "mha_error_"), _mutated_attention())
