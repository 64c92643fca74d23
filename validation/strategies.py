"""Hypothesis strategies for valid calls of the three ops, over every attribute value their specs allow.

One copy shared by the project's tests and ``kvcache-op fuzz`` (which runs them against a user's backend).
Importing this module needs ``hypothesis``; nothing else in the package does.
"""

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from ..reference import INT4, cache_shape, rotary_shift_tables
from ..reference.dtypes import BFLOAT16
from .cases import Seq, build, with_empty_scale
from .mha_cases import build_attention
from .outcome import copies  # noqa: F401 - the tests' helper, shared

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


@st.composite
def sequences(draw, max_batch=4, max_pos=12, max_len=6, min_batch=0, min_len=0):
    """A batch of (start_pos, seqlen, kvlen) with kvlen <= start_pos + seqlen; empty ones included unless
    ``min_len`` says otherwise."""
    seqs = []
    for _ in range(draw(st.integers(min_batch, max_batch))):
        start = draw(st.integers(0, max_pos))
        seqlen = draw(st.integers(min_len, max_len))
        kvlen = draw(st.one_of(st.just(-1), st.integers(0, start + seqlen)))
        seqs.append(Seq(start, seqlen, kvlen))
    return seqs


#: Bits of special values per float dtype: -0.0, +inf, -inf, the smallest subnormal, a quiet NaN with a payload and
#: a negative one. Unquantized data movement is exact, so a backend must store and load these bits as they are.
SPECIAL_BITS = {np.dtype(np.float32): np.array([0x80000000, 0x7F800000, 0xFF800000, 0x1, 0x7FC00123, 0xFFC00001],
                                               np.uint32),
                np.dtype(np.float16): np.array([0x8000, 0x7C00, 0xFC00, 0x1, 0x7E01, 0xFE01], np.uint16),
                BFLOAT16: np.array([0x8000, 0x7F80, 0xFF80, 0x1, 0x7FC1, 0xFFC1], np.uint16)}


def with_special_values(case, seed: int):
    """``case`` (unquantized) with each of :data:`SPECIAL_BITS` planted in ``current_key``, ``current_value`` and
    the cache at random elements (where they have any)."""
    rng = np.random.default_rng(seed)
    for name in ("current_key", "current_value", "cache"):
        array = case.inputs[name] = np.array(case.inputs[name], copy=True)
        if array.size:
            bits = SPECIAL_BITS[array.dtype]
            array.reshape(-1)[rng.integers(0, array.size, bits.size)] = bits.view(array.dtype)
    return case


@st.composite
def calls(draw, quant_bits=(0, 4, 8), modes=(0, 1), layouts=(0, 1, 2, 3), t1s=("float32", "float16", "bfloat16"),
          max_batch=4, head_dims=(1, 2, 3, 4, 6, 8, 16), min_batch=0, min_len=0, special_values=True):
    """A valid KeyValueCache call: returns a spec.cases.Case (inputs + attributes). ``head_dims``, ``min_batch``
    and ``min_len`` narrow it (e.g. to calls that quantize many elements per group). An unquantized call holds
    special values (:func:`with_special_values`) one time in three unless ``special_values`` is False."""
    quant_bit = draw(st.sampled_from(quant_bits))
    head_dim = draw(st.sampled_from([d for d in head_dims if d in (2, 4, 8, 16)] if quant_bit == 4 else head_dims))
    quant_group = draw(st.sampled_from([g for g in (1, 2, 3, 4, 8, 16) if head_dim % g == 0]))
    num_layer = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(modes))
    page_size = draw(st.sampled_from((1, 2, 3, 4, 8))) if mode == 1 else 128
    seqs = draw(sequences(max_batch=max_batch, min_batch=min_batch, min_len=min_len))
    if mode == 1:  # share read-only prefix pages between sequences (prefix caching)
        for b in range(1, len(seqs)):
            owner = draw(st.integers(0, b - 1))
            shareable = min(seqs[b].start_pos, seqs[owner].start_pos) // page_size
            if seqs[owner].share_pages_of < 0 and shareable and draw(st.booleans()):
                s = seqs[b]
                seqs[b] = Seq(s.start_pos, s.seqlen, s.kvlen, owner, draw(st.integers(1, shareable)))
    case = build(
        "hypothesis", seqs, heads=draw(st.integers(1, 3)), head_dim=head_dim, num_layer=num_layer,
        layer_idx=draw(st.integers(0, num_layer - 1)), quant_bit=quant_bit, quant_group=quant_group,
        num_repeat=draw(st.integers(1, 3)), cache_mode=mode, cache_layout=draw(st.sampled_from(layouts)),
        page_size=page_size, t1=draw(st.sampled_from(t1s)), t3=draw(st.sampled_from(("float32", "float16"))),
        scalar_max=draw(st.booleans()), extra_max=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**32 - 1)),
        tail_slots=draw(st.integers(0, 3)), spare_pages=draw(st.integers(0, 2)),
        empty_offsets_minus_one=draw(st.booleans()), aligned_pages=mode == 0 or draw(st.booleans()),
    )
    if not quant_bit and special_values and draw(st.integers(0, 2)) == 0:
        case = with_special_values(case, draw(st.integers(0, 2**32 - 1)))
    if not quant_bit and draw(st.booleans()):  # the empty placeholder scale of ppl.pmx's export: absent
        case = with_empty_scale(case, DTYPES[draw(st.sampled_from(sorted(DTYPES)))])
    return case


#: (quant_bit, cache_mode, cache_layout): property tests are parametrized over all of them so every
#: combination gets its own examples, whatever hypothesis's search prefers.
COMBINATIONS = [(q, m, lay) for q in (0, 4, 8) for m in (0, 1) for lay in range(4)]


def calls_for(combo, **kw):
    """:func:`calls` pinned to one (quant_bit, cache_mode, cache_layout)."""
    q, m, lay = combo
    return calls(quant_bits=(q,), modes=(m,), layouts=(lay,), **kw)


@st.composite
def shift_calls(draw):
    """A valid KeyCacheRotaryShift call: (inputs, attributes)."""
    quant_bit = draw(st.sampled_from((0, 4, 8)))
    head_dim = draw(st.sampled_from((2, 4, 8, 16)))
    layout = draw(st.integers(0, 3))
    layers = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 3))
    max_t = draw(st.integers(1, 12))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if head_dim % g == 0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if quant_bit:
        q = 7 if quant_bit == 4 else 127
        cache = rng.integers(-q, q + 1, cache_shape(layout, layers, max_t, heads, head_dim)).astype(
            np.int8 if quant_bit == 8 else INT4)
        scale = rng.uniform(0.01, 0.1, cache_shape(layout, layers, max_t, heads, head_dim // group)).astype(
            draw(st.sampled_from((np.float32, np.float16))))
    else:
        dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
        values = rng.standard_normal(cache_shape(layout, layers, max_t, heads, head_dim)) * 2
        if draw(st.integers(0, 2)) == 0:  # subnormal keys (a tenth of the smallest normal): none of their rotations
            values *= float(ml_dtypes.finfo(dtype).tiny) / 10  # may be flushed to zero
        cache = values.astype(dtype)
        scale = None
    n = draw(st.integers(0, max_t))
    slots = rng.permutation(max_t)[:n].astype(np.int64)
    rotary = draw(st.sampled_from([r for r in (0, 2, 4, 8, 16) if r <= head_dim]))
    cos, sin = rotary_shift_tables(rng.integers(-50, 50, n), rotary or head_dim)
    attrs = dict(num_layer=layers, layer_idx=draw(st.integers(0, layers - 1)), cache_layout=layout,
                 quant_bit=quant_bit, quant_group=group, rotary_dim=rotary,
                 rotary_interleaved=draw(st.integers(0, 1)))
    return {"cache": cache, "scale": scale, "slots": slots, "cos": cos, "sin": sin}, attrs


ATTENTION_DTYPES = ("float32", "float16", "bfloat16")

#: The non-finite values an attention call may hold: each reaches a row by the spec's rules ("Non-finite values").
ATTENTION_SPECIALS = (np.inf, -np.inf, np.nan)


def with_attention_special_values(case, seed: int):
    """``case`` with one to three of :data:`ATTENTION_SPECIALS` planted at random elements of ``query``, ``key``,
    ``value`` and ``attn_mask`` (where they have any)."""
    rng = np.random.default_rng(seed)
    present = [n for n in ("query", "key", "value", "attn_mask") if case.inputs.get(n) is not None]
    names = [n for n in present if case.inputs[n].size]
    for _ in range(int(rng.integers(1, 4)) if names else 0):
        name = names[int(rng.integers(len(names)))]
        array = case.inputs[name] = np.array(case.inputs[name], copy=True)
        array.reshape(-1)[rng.integers(array.size)] = ATTENTION_SPECIALS[int(rng.integers(len(ATTENTION_SPECIALS)))]
    return case


@st.composite
def attention_calls(draw, dtypes=ATTENTION_DTYPES, max_batch=4, max_kvlen=12, head_dims=(1, 2, 3, 4, 8, 16),
                    max_seqlen=5, special_values=False):
    """A valid MultiHeadAttention call (GQA, causal on/off, decoding sequences, windows, masks of both ranks
    with -inf entries and unread columns, ALiBi, empty sequences, all three dtypes): a spec.cases.Case.
    Sequences hold up to ``max_seqlen`` queries (more than a kernel's tile of query rows reaches its tiled
    prefill path). With ``special_values``, one call in three holds infinities or NaNs
    (:func:`with_attention_special_values`)."""
    heads = draw(st.sampled_from((1, 2, 3, 4, 6)))
    kv_heads = draw(st.sampled_from([0] + [k for k in (1, 2, 3, 6) if heads % k == 0]))
    batch = draw(st.integers(0, max_batch))
    decoding = draw(st.integers(0, batch))
    is_causal = draw(st.sampled_from((1, 1, 0)))
    seqs = []
    for b in range(batch):
        kvlen = draw(st.integers(0, max_kvlen))
        seqlen = draw(st.integers(0, max_seqlen))
        if is_causal and b >= decoding and seqlen > 1 and seqlen > kvlen:
            kvlen = seqlen + draw(st.integers(0, 3))  # the causal rule needs seqlen <= kvlen
        seqs.append((seqlen, kvlen))
    mask = draw(st.sampled_from((None, None, 2, 3)))
    case = build_attention(
        "hypothesis", seqs, heads=heads, kv_heads=kv_heads, head_dim=draw(st.sampled_from(head_dims)),
        t=draw(st.sampled_from(dtypes)), decoding=decoding, is_causal=is_causal, is_alibi=draw(st.integers(0, 1)),
        sliding_window=draw(st.sampled_from((0, 0, 1, 2, 3, 5, 100))),
        softmax_scale=draw(st.sampled_from((0.0, 0.0, 0.05, 0.3, 1.0))),
        softcap=draw(st.sampled_from((0.0, 0.0, 0.0, 0.5, 5.0))), mask=mask,
        mask_extra_cols=draw(st.integers(0, 2)), mask_neg_inf=draw(st.sampled_from((0.0, 0.3, 0.9))),
        scalar_max=draw(st.booleans()), extra_max=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**32 - 1)),
    )
    if special_values and draw(st.sampled_from((False, False, True))):  # shrinks to calls without them
        case = with_attention_special_values(case, draw(st.integers(0, 2**32 - 1)))
    return case


@st.composite
def cache_attention_calls(draw, kv_calls=None):
    """A valid MultiHeadCacheAttention call: a KeyValueCache call drawn from ``kv_calls`` (default :func:`calls`
    without special values, which the attention bound does not cover; num_repeat set to 1) with a query of 1-3 heads per kv head, decoding sequences, causal on/off (off where a causal
    sequence would have fewer keys than queries), ALiBi, windows and an additive mask (shared by the heads, or a plane
    per query head): a spec.cases.Case."""
    from .mhca_cases import with_query

    case = draw(kv_calls if kv_calls is not None else calls(special_values=False))
    seq_len, kv_len = np.diff(case.inputs["seqstarts"]), np.diff(case.inputs["kvstarts"])
    batch = len(seq_len)
    decoding = draw(st.integers(0, batch))
    causal = draw(st.sampled_from((1, 1, 0)))
    if causal and any(seq_len[b] > 1 and seq_len[b] > kv_len[b] for b in range(decoding, batch)):
        causal = 0
    return with_query(f"hypothesis-{draw(st.integers(0, 2**32 - 1))}", case.inputs,
                      {**case.attributes, "num_repeat": 1}, group=draw(st.sampled_from((1, 2, 3))), decoding=decoding,
                      is_causal=causal, is_alibi=draw(st.integers(0, 1)),
                      sliding_window=draw(st.sampled_from((0, 0, 1, 3))),
                      softmax_scale=draw(st.sampled_from((0.0, 0.0, 0.3))),
                      softcap=draw(st.sampled_from((0.0, 0.0, 0.5, 5.0))), mask=draw(st.sampled_from((0, 0, 2, 3))))
