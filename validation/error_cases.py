"""Every validity condition of spec/KeyValueCache.md, as (id, base case, mutation, expected message) rows.

``INVALID`` is shared by the reference tests and every backend's error tests, so each backend is held to
the same list; ``MORE_INVALID`` adds the conditions those rows leave out (zero heads, other index dtypes,
an empty batch, a page repeated in one table, bounds errors of quantized caches). Both become named
conformance cases ``error_<id>`` whose expected outcome is an error with cache and scale byte-for-byte
unchanged (validation/vectors.py). A mutation takes (inputs, attributes) and changes them in place; the
messages are regular expressions the reference's message matches.
"""

import numpy as np

from ..reference.dtypes import BFLOAT16
from .cases import Seq, build

I64_MAX = np.iinfo(np.int64).max


def base(name, kw=None):
    """Small valid calls the mutations start from: offset or paged, plain or int8/int4; ``paged_long`` is one
    sequence storing six tokens across two pages; in ``paged_partial`` the first sequence loads two pages and stores
    nothing, the second stores pages 1 and 2 and loads page 0 (a last page checked as a load alone, a first and a
    last page as a store alone)."""
    presets = {
        "offset": dict(cache_mode=0),
        "paged": dict(cache_mode=1, page_size=4),
        "offset_int8": dict(cache_mode=0, quant_bit=8, quant_group=4),
        "paged_int4": dict(cache_mode=1, page_size=4, quant_bit=4, quant_group=4),
        "paged_long": dict(cache_mode=1, page_size=4),
        "paged_partial": dict(cache_mode=1, page_size=4),
    }
    seqs = {"paged_long": [Seq(0, 6)], "paged_partial": [Seq(5, 0), Seq(4, 6, kvlen=4)]}.get(
        name, [Seq(0, 3), Seq(5, 1), Seq(2, 2)])
    return build(f"invalid-{name}", seqs, **{**presets[name], **(kw or {})})


def _set(key, value):
    def mutate(i, a):
        (a if key in a else i)[key] = value
    return mutate


def _item(key, index, value):
    def mutate(i, a):
        i[key] = i[key].copy()
        i[key][index] = value
    return mutate


def _apply(fn):
    def mutate(i, a):
        fn(i, a)
    return mutate


def _reshape(key, fn):
    """Replaces an input by a (contiguous) reshaped copy: these rows test shapes, not memory order."""
    return _apply(lambda i, a: i.__setitem__(key, np.ascontiguousarray(fn(i[key]))))


def _retype(key, dtype):
    return _apply(lambda i, a: i.__setitem__(key, None if i[key] is None else i[key].astype(dtype)))


def _far_positions_in_one_huge_page(i, a):
    """Sequence 0 stores at [2**40 - 3, 2**40) and loads [0, 2**40), all in page 0 of a 2**40-slot page: a
    page bounds error, found from page numbers (no array of 2**40 positions is ever built)."""
    a["page_size"] = 2**40
    i["start_pos"] = i["start_pos"].copy()
    i["start_pos"][0] = 2**40 - 3
    i["kvstarts"] = i["kvstarts"].copy()
    i["kvstarts"][1:] += 2**40 - 3
    i["max_kvlen"] = np.array(2**40, np.int64)


INVALID = [
    # attributes
    ("num_layer_zero", "offset", _set("num_layer", 0), "num_layer must be >= 1"),
    ("layer_idx_too_big", "offset", _set("layer_idx", 1), r"layer_idx must be in \[0, num_layer=1\), got 1"),
    ("layer_idx_negative", "offset", _set("layer_idx", -1), "layer_idx must be in"),
    ("quant_bit_unsupported", "offset", _set("quant_bit", 2), "quant_bit must be 0, 4 or 8, got 2"),
    ("quant_group_zero", "offset_int8", _set("quant_group", 0), "quant_group must be >= 1"),
    ("num_repeat_zero", "offset", _set("num_repeat", 0), "num_repeat must be >= 1"),
    ("cache_mode_2", "offset", _set("cache_mode", 2), "cache_mode must be 0"),
    ("cache_layout_4", "offset", _set("cache_layout", 4), "cache_layout must be 0, 1, 2 or 3"),
    ("page_size_zero", "paged", _set("page_size", 0), "page_size must be >= 1"),
    # data tensors
    ("current_key_int8", "offset", _retype("current_key", np.int8), "current_key dtype must be"),
    ("current_key_rank2", "offset", _reshape("current_key", lambda x: x[:, 0]),
     "current_key must have rank 3"),
    ("current_value_shape", "offset", _reshape("current_value", lambda x: x[:, :, :4]),
     "current_value .* must match current_key"),
    ("current_value_dtype", "offset", _retype("current_value", np.float32), "current_value .* must match"),
    ("cache_dtype_not_t1", "offset", _retype("cache", np.float32), "cache dtype must be float16"),
    ("cache_dtype_not_int8", "offset_int8", _retype("cache", np.int16), "cache dtype must be int8"),
    ("cache_rank4", "offset", _reshape("cache", lambda x: x[0]), "cache must have rank 5"),
    ("cache_wrong_num_layer", "offset", _set("num_layer", 2), r"cache shape must be .*num_layer=2"),
    ("cache_wrong_heads", "offset", _reshape("cache", lambda x: x[:, :, :, :1]),
     "cache shape must be"),
    ("cache_wrong_head_dim", "offset", _reshape("cache", lambda x: x[..., :4]),
     "cache shape must be"),
    ("scale_with_quant0", "offset", _apply(lambda i, a: i.__setitem__("scale", np.zeros(1, np.float32))),
     "scale must be absent when quant_bit is 0"),
    ("quant_group_not_dividing", "offset_int8", _set("quant_group", 3), "quant_group=3 must divide Dh=8"),
    ("int4_odd_head_dim", ("paged_int4", dict(head_dim=3, quant_group=1)), _apply(lambda i, a: None),
     "int4 cache needs an even Dh"),
    ("scale_missing", "offset_int8", _set("scale", None), "scale is required when quant_bit is 8"),
    ("scale_dtype", "offset_int8", _retype("scale", np.int32), "scale dtype must be float32 or float16"),
    ("scale_shape", "offset_int8", _apply(lambda i, a: i.__setitem__("scale", np.concatenate([i["scale"]] * 2, -1))),
     "scale shape must be"),
    # index tensors
    ("seqstarts_int32", "offset", _retype("seqstarts", np.int32), "seqstarts must be int64"),
    ("seqstarts_2d", "offset", _apply(lambda i, a: i.__setitem__("seqstarts", i["seqstarts"][None])),
     "seqstarts must be 1-D"),
    ("seqstarts_empty", "offset", _apply(lambda i, a: i.__setitem__("seqstarts", np.zeros(0, np.int64))),
     "seqstarts must have B \\+ 1 >= 1"),
    ("kvstarts_length", "offset", _apply(lambda i, a: i.__setitem__("kvstarts", i["kvstarts"][:-1])),
     r"kvstarts must have shape \(4,\)"),
    ("start_pos_length", "offset", _apply(lambda i, a: i.__setitem__("start_pos", i["start_pos"][:-1])),
     r"start_pos must have shape \(3,\)"),
    ("cachestarts_int32", "offset", _retype("cachestarts", np.int32), "cachestarts must be int64"),
    ("cachestarts_rank_for_paged", "offset", _set("cache_mode", 1), r"cachestarts must have shape \(B, MaxP\)"),
    ("cachestarts_rank_for_offset", "paged", _set("cache_mode", 0), r"cachestarts must have shape \(B,\)"),
    ("max_seqlen_shape2", "offset", _set("max_seqlen", np.array([9, 9], np.int64)), "max_seqlen must be a scalar"),
    ("max_kvlen_float", "offset", _set("max_kvlen", np.array(9.0)), "max_kvlen must be an int64 scalar"),
    ("seqstarts_not_zero", "offset", _item("seqstarts", 0, 1), r"seqstarts\[0\] must be 0, got 1"),
    ("seqstarts_decreasing", "offset", _item("seqstarts", 2, 2), r"seqstarts must be non-decreasing: seqstarts\[2\] = 2 < seqstarts\[1\] = 3"),
    ("seqstarts_total", "offset", _item("seqstarts", 3, 5), r"seqstarts\[B=3\] = 5 must equal current_key.shape\[0\] = 6"),
    ("kvstarts_not_zero", "offset", _item("kvstarts", 0, -1), r"kvstarts\[0\] must be 0"),
    ("kvstarts_decreasing", "offset", _item("kvstarts", 1, 20), "kvstarts must be non-decreasing"),
    ("max_seqlen_too_small", "offset", _set("max_seqlen", np.array(2, np.int64)),
     "max_seqlen = 2 is smaller than seqlen of sequence 0 = 3"),
    ("max_kvlen_too_small", "offset", _set("max_kvlen", np.array([1], np.int64)), "max_kvlen = 1 is smaller"),
    ("start_pos_negative", "offset", _item("start_pos", 1, -1), r"start_pos\[1\] = -1 must be >= 0"),
    ("kvlen_beyond_stored", "offset", _item("start_pos", 1, 4),
     "kvlen of sequence 1 = 6 exceeds start_pos\\[1\\] \\+ seqlen = 4 \\+ 1 = 5"),
    ("offset_cachestarts_negative", "offset", _item("cachestarts", 2, -1), r"cachestarts\[2\] = -1"),
    ("offset_beyond_max_t", "offset", _item("cachestarts", 2, 1000), r"cachestarts\[2\] = 1000: .*<= MaxT"),
    ("offset_start_pos_int64_max", "offset", _item("start_pos", 1, I64_MAX), r"cachestarts\[1\]"),
    ("paged_page_beyond_max_p", "paged", _item("start_pos", 1, 40), r"page 10, but cachestarts has MaxP"),
    ("paged_sentinel_minus_one", "paged", _item("cachestarts", (1, 0), -1), r"cachestarts\[1, 0\] = -1"),
    ("paged_int64_max_page", "paged", _item("cachestarts", (0, 0), I64_MAX), r"cachestarts\[0, 0\] = 9223372036854775807"),
    ("paged_load_only_last_page_minus_one", "paged_partial", _item("cachestarts", (0, 1), -1),
     r"cachestarts\[0, 1\] = -1"),
    ("paged_store_only_first_page_minus_one", "paged_partial", _item("cachestarts", (1, 1), -1),
     r"cachestarts\[1, 1\] = -1"),
    ("paged_store_only_last_page_minus_one", "paged_partial", _item("cachestarts", (1, 2), -1),
     r"cachestarts\[1, 2\] = -1"),
    ("paged_page_past_end", "paged", _apply(lambda i, a: i["cachestarts"].__setitem__((2, 0), i["cache"].shape[0] - 2)),
     "page_size \\(4\\) <= MaxT"),
    ("paged_start_pos_int64_max", "paged", _item("start_pos", 1, I64_MAX), "but cachestarts has MaxP"),
    ("paged_huge_page_size_far_positions", "paged", _apply(_far_positions_in_one_huge_page),
     r"cachestarts\[0, 0\] = \d+: page 0 of sequence 0 is used"),
    ("num_repeat_heads_overflow", "offset", _set("num_repeat", 2**62),
     r"KeyValueCache output key would have H\*num_repeat=2\*4611686018427387904 heads: H\*num_repeat does not "
     r"fit in int64"),
    ("num_repeat_row_bytes_overflow", "offset", _set("num_repeat", 2**58),
     r"KeyValueCache output key would be \(kv_tokens=13, H\*num_repeat=2\*288230376151711744, Dh=8\) elements "
     r"of float16: a single row would be 2\^63 bytes or more"),
    ("num_repeat_output_bytes_overflow", "offset", _set("num_repeat", 2**55),
     r"KeyValueCache output key would be \(kv_tokens=13, H\*num_repeat=2\*36028797018963968, Dh=8\) elements "
     r"of float16: 2\^63 bytes or more"),
    ("slot_stored_twice", "offset", _apply(lambda i, a: i["cachestarts"].__setitem__(2, i["cachestarts"][0])),
     "is stored twice in one call"),
    ("stored_slot_loaded_by_other_sequence", "paged", _apply(lambda i, a: i["cachestarts"].__setitem__((2, 0), i["cachestarts"][1, 0])),
     "loaded in the same call by sequence"),
    ("stored_slot_loaded_at_other_position", "paged", _apply(lambda i, a: i["cachestarts"].__setitem__((1, 0), i["cachestarts"][1, 1])),
     "may only be loaded by its own sequence at its own position"),
]

def with_slots_appended(inputs, layout: int, count: int) -> int:
    """Grows ``cache`` (and a non-empty ``scale``) by ``count`` slots past MaxT, copies of the first ones; returns the
    old MaxT, the first new slot."""
    max_t = inputs["cache"].shape[layout]
    for name in ("cache", "scale"):
        x = inputs[name]
        if x is not None and x.size:
            inputs[name] = np.ascontiguousarray(np.concatenate([x, np.take(x, range(count), axis=layout)], layout))
    return max_t


def _page_past_end_touched_inside(i, a):
    """Sequence 0 (positions 0-2 of page 0) moved to three slots appended to the cache: every slot it touches is
    inside, and nobody else's, but its page of 4 runs one slot past MaxT."""
    i["cachestarts"] = i["cachestarts"].copy()
    i["cachestarts"][0, 0] = with_slots_appended(i, a["cache_layout"], 3)


def _empty_batch(i, a):
    """B = 0: no tokens, no sequences (max_seqlen is then only required to be >= 0)."""
    for name in ("current_key", "current_value"):
        i[name] = i[name][:0].copy()
    i.update(seqstarts=np.zeros(1, np.int64), kvstarts=np.zeros(1, np.int64), cachestarts=np.zeros(0, np.int64),
             start_pos=np.zeros(0, np.int64))


def _zero_dims(shape):
    """current_key and current_value of the given (tokens, H, Dh) shape, zeros."""
    def mutate(i, a):
        i["current_key"] = np.zeros(shape, i["current_key"].dtype)
        i["current_value"] = np.zeros(shape, i["current_value"].dtype)
    return mutate


def _both(*mutations):
    """The mutations one after the other."""
    def mutate(i, a):
        for m in mutations:
            m(i, a)
    return mutate


MORE_INVALID = [
    ("current_key_zero_heads", "offset", _zero_dims((6, 0, 8)), r"current_key must have H >= 1 and Dh >= 1"),
    ("current_key_zero_head_dim", "offset", _zero_dims((6, 2, 0)), r"current_key must have H >= 1 and Dh >= 1"),
    ("cache_dtype_not_int4", "paged_int4", _retype("cache", np.int8), "cache dtype must be int4"),
    ("cache_kv_axis_3", "offset", _reshape("cache", lambda x: np.concatenate([x, x[:, :, :1]], axis=2)),
     "cache shape must be"),
    ("scale_bfloat16_quantized", "offset_int8", _retype("scale", BFLOAT16), "scale dtype must be float32 or float16"),
    ("kvstarts_int32", "offset", _retype("kvstarts", np.int32), "kvstarts must be int64"),
    ("start_pos_int32", "offset", _retype("start_pos", np.int32), "start_pos must be int64"),
    ("max_seqlen_rank2", "offset", _set("max_seqlen", np.array([[9]], np.int64)), "max_seqlen must be a scalar"),
    ("batch0_max_seqlen_negative", "offset", _both(_empty_batch, _set("max_seqlen", np.array(-1, np.int64))),
     "max_seqlen = -1 must be >= 0"),
    ("batch0_max_kvlen_negative", "offset", _both(_empty_batch, _set("max_kvlen", np.array([-2], np.int64))),
     "max_kvlen = -2 must be >= 0"),
    ("paged_page_repeated_in_one_table", "paged_long",
     _apply(lambda i, a: i["cachestarts"].__setitem__((0, 1), i["cachestarts"][0, 0])), "is stored twice in one call"),
    ("int8_offset_beyond_max_t", "offset_int8", _item("cachestarts", 2, 1000), r"cachestarts\[2\] = 1000"),
    ("int8_max_seqlen_too_small", "offset_int8", _set("max_seqlen", np.array(1, np.int64)),
     "max_seqlen = 1 is smaller than seqlen of sequence 0 = 3"),
    ("int4_paged_sentinel_minus_one", "paged_int4", _item("cachestarts", (1, 0), -1), r"cachestarts\[1, 0\] = -1"),
    ("int4_paged_page_beyond_max_p", "paged_int4", _item("start_pos", 1, 40), r"page 10, but cachestarts has MaxP"),
    # The whole page must lie in the cache, not only its touched slots (a check of the touched slots passes it).
    ("paged_page_past_end_touched_inside", "paged", _apply(_page_past_end_touched_inside), "page_size \\(4\\) <= MaxT"),
    ("int4_slot_stored_twice", "paged_int4",
     _apply(lambda i, a: i["cachestarts"].__setitem__((2, 0), i["cachestarts"][0, 0])), "is stored twice"),
]


def mutated(case, change) -> tuple:
    """(inputs, attributes) of ``case`` after ``change(inputs, attributes)``, on fresh copies of its inputs."""
    inputs = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
    attributes = dict(case.attributes)
    change(inputs, attributes)
    return inputs, attributes


def make_invalid(row):
    """(inputs, attributes) of one invalid row; inputs are fresh copies."""
    name, base_name, mutation, _ = row
    case = base(*base_name) if isinstance(base_name, tuple) else base(base_name)
    inputs, attrs = dict(case.inputs), dict(case.attributes)
    mutation(inputs, attrs)
    return inputs, attrs

