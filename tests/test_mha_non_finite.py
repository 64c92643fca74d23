"""MultiHeadAttention at the edges the spec settles explicitly: NaN propagates (never an exact-zero row),
keys outside the causal or window range never reach a row (not even their inf/NaN), a -inf mask entry
gives weight 0 but keeps the key in the sums, overflowed scores, the float32 rounding of softmax_scale,
and declared shapes whose byte counts overflow int64. The reference and the C++ kernel agree on each."""

import numpy as np
import pytest

from kvcache_op.capi import c_api
from kvcache_op.reference import MultiHeadAttentionError, multi_head_attention
from kvcache_op.validation.mha_cases import build_attention
from processes import run_script

BACKENDS = {"reference": multi_head_attention, "kernel": c_api.multi_head_attention}
# The spec settles these values as IEEE float32 arithmetic gives them: the reference computes them without a
# numpy warning (a user checking a backend against it sees none for a case the spec defines).
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def causal_chunk(t="float32"):
    """One causal chunk of 4 queries over 4 keys (query i sees keys 0..i), 1 head."""
    return build_attention("non-finite", [(4, 4)], heads=1, head_dim=2, t=t, is_causal=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["key", "value", "query"])
def test_a_nan_a_row_reads_makes_that_row_nan_not_zero(backend, where):
    case = causal_chunk()
    case.inputs[where][0 if where != "query" else 3, 0, 0] = np.nan  # key/value 0: seen by every query
    out = BACKENDS[backend](**case.inputs, **case.attributes)
    rows = [3] if where == "query" else [0, 1, 2, 3]
    assert np.isnan(out[rows]).any(axis=(1, 2)).all(), out
    others = [r for r in range(4) if r not in rows]
    assert np.isfinite(out[others]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_under_a_minus_inf_mask_reaches_the_row_when_a_long_decode_is_split(backend):
    """The kernel splits a lone decode over 1024 keys into parts merged by log-sum-exp; the part whose scores are
    all -inf (masked) still carries its NaN value into the row, as one pass does."""
    case = build_attention("nan-split", [(1, 1024)], heads=1, head_dim=8, t="float32", mask=2)
    case.inputs["attn_mask"][0, :512] = -np.inf
    case.inputs["value"][0, 0, 0] = np.nan
    out = BACKENDS[backend](**case.inputs, **case.attributes)
    assert np.isnan(out[0]).any(), out[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_keys_outside_the_causal_range_never_reach_a_row(backend, bad):
    case = causal_chunk()
    case.inputs["value"][3, 0, :] = bad  # key 3 is visible to query 3 only
    case.inputs["key"][3, 0, :] = bad
    out = BACKENDS[backend](**case.inputs, **case.attributes)
    assert np.isfinite(out[:3]).all(), out
    clean = causal_chunk()
    clean.inputs["value"][3] = 0
    clean.inputs["key"][3] = 0
    want = multi_head_attention(**clean.inputs, **clean.attributes)
    assert np.allclose(out[:3], want[:3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_minus_inf_mask_entry_gives_weight_zero_but_keeps_the_key_in_the_sums(backend):
    case = build_attention("masked", [(1, 4)], heads=1, head_dim=2, decoding=1, mask=2)
    case.inputs["attn_mask"][:] = 0
    case.inputs["attn_mask"][0, 2] = -np.inf
    finite = BACKENDS[backend](**case.inputs, **case.attributes)
    dropped = build_attention("masked", [(1, 4)], heads=1, head_dim=2, decoding=1)
    keep = [0, 1, 3]
    dropped.inputs["key"], dropped.inputs["value"] = case.inputs["key"][keep], case.inputs["value"][keep]
    dropped.inputs["kvstarts"] = np.array([0, 3], np.int64)
    assert np.allclose(finite, multi_head_attention(**dropped.inputs, **dropped.attributes), rtol=1e-5, atol=1e-6)
    case.inputs["value"][2] = np.nan  # weight 0, but 0 * NaN is NaN: the spec keeps the key in the sums
    assert np.isnan(BACKENDS[backend](**case.inputs, **case.attributes)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scores_that_all_overflow_to_minus_inf_give_a_zero_row(backend):
    case = build_attention("overflow", [(1, 3)], heads=1, head_dim=1, t="bfloat16", decoding=1)
    case.inputs["query"][:] = 1e30
    case.inputs["key"][:] = -1e30
    out = BACKENDS[backend](**case.inputs, **case.attributes)
    assert (np.asarray(out, np.float32) == 0).all()


@pytest.mark.parametrize("scale", [1e-50, 0.0])
def test_a_softmax_scale_that_rounds_to_zero_in_float32_is_the_default(scale):
    case = build_attention("scale", [(2, 5)], heads=2, head_dim=4, decoding=0)
    default = multi_head_attention(**case.inputs, **dict(case.attributes, softmax_scale=0.0))
    for backend in BACKENDS.values():
        got = backend(**case.inputs, **dict(case.attributes, softmax_scale=scale))
        assert np.allclose(got, default, rtol=1e-3, atol=1e-3)


def test_a_softmax_scale_overflowing_float32_is_named_as_the_graph_holds_it():
    case = build_attention("scale", [(1, 2)], heads=1, head_dim=2, decoding=1)
    for backend in BACKENDS.values():
        with pytest.raises(MultiHeadAttentionError, match="got inf"):
            backend(**case.inputs, **dict(case.attributes, softmax_scale=1e39))


def test_a_mask_whose_byte_count_overflows_is_refused_with_the_output_untouched():
    """A declared width of 2^62 float16 elements: 2^63 bytes, which wraps in int64. It must not slip past the
    output-overlap check (the output here lies inside the mask's declared range)."""
    case = build_attention("huge-mask", [(1, 3)], heads=1, head_dim=4, t="float16", decoding=1, mask=2)
    buffers = c_api.HostBuffers()
    inputs = [buffers.tensor(name, case.inputs[name]) for name in c_api.MHA_INPUTS[:8]]
    mask = case.inputs["attn_mask"]
    inputs.append(c_api.Tensor(c_api.onnx_type(mask.dtype), (1, 2**62), mask.ctypes.data))
    output = c_api.Tensor(c_api.onnx_type(mask.dtype), case.inputs["query"].shape, mask.ctypes.data)
    before = mask.tobytes()
    with pytest.raises(MultiHeadAttentionError, match="more than 2\\^63 - 1 bytes|overlaps"):
        c_api.run_multi_head_attention(inputs, output, **case.attributes)
    assert mask.tobytes() == before
    del buffers


def test_running_out_of_threads_is_not_a_crash():
    """Asked for far more threads than the address space allows, the entry point uses the threads it got."""
    script = """
        import resource
        import numpy as np
        from kvcache_op.capi import c_api
        from kvcache_op.validation.mha_cases import build_attention

        case = build_attention("threads", [(1, 64)] * 300, heads=2, head_dim=8, decoding=300)
        want = c_api.multi_head_attention(**case.inputs, **case.attributes, num_threads=1)
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) for line in status if line.startswith("VmSize")) * 1024
        limit = vm + 256 * 2**20  # room for a few thread stacks, not for 300
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        got = c_api.multi_head_attention(**case.inputs, **case.attributes, num_threads=300)
        assert got.tobytes() == want.tobytes()
        print("ok")
    """
    child = run_script(script)
    assert child.returncode == 0 and "ok" in child.stdout, (child.returncode, child.stdout, child.stderr[-2000:])


def test_the_kit_accepts_an_attention_output_of_the_same_infinity_and_no_other():
    """An infinite value every query reads gives infinite output rows: the reference checked against itself passes
    (|inf - inf| is NaN, which no bound admits: the kit failed it), and an infinity of the other sign or a finite
    number in its place fails (the bound there is infinite too, which admitted them)."""
    from kvcache_op.validation.compare import compare
    from kvcache_op.validation.outcome import Outcome, reference_outcome

    case = causal_chunk()
    case.inputs["value"][0, 0, 0] = -np.inf  # key/value 0: seen by every query
    want = reference_outcome("MultiHeadAttention", case.inputs, case.attributes)
    out = want.outputs["attention_output"]
    assert np.isneginf(out[:, 0, 0]).all()
    assert compare("MultiHeadAttention", case.inputs, case.attributes, want, want, "spec") == []
    for wrong in (np.inf, 0.0):
        changed = out.copy()
        changed[2, 0, 0] = wrong
        got = Outcome(outputs={"attention_output": changed}, tolerance=want.tolerance)
        assert compare("MultiHeadAttention", case.inputs, case.attributes, want, got, "spec"), wrong


def _judged(inputs, attributes, output) -> list:
    """The kit's problems with ``output`` as a MultiHeadAttention backend's answer to the call."""
    from kvcache_op.validation.compare import compare
    from kvcache_op.validation.outcome import Outcome, reference_outcome

    want = reference_outcome("MultiHeadAttention", inputs, attributes)
    got = Outcome(outputs={"attention_output": np.asarray(output, np.float32)}, tolerance=want.tolerance)
    return compare("MultiHeadAttention", inputs, attributes, want, got, "spec")


def _one_query(key, value, **attributes):
    lengths = dict(seqstarts=np.array([0, 1]), kvstarts=np.array([0, len(key)]), decoding_batches=np.array(0),
                   max_seqlen=np.array(1), max_kvlen=np.array(len(key)))
    query = np.ones((1, 1, key.shape[-1]), np.float32)
    return dict(query=query, key=key[:, None, :].astype(np.float32), value=value[:, None, :].astype(np.float32),
                **lengths), dict(num_heads=1, head_dim=key.shape[-1], softmax_scale=1.0, **attributes)


def test_a_row_whose_weighted_sum_overflows_float32_may_be_infinite_or_exact():
    """Two values of 3e38 under equal scores: the exact output is 3e38. Summing before the division overflows to inf
    (the reference), dividing first gives 3e38 (allowed: the spec leaves the order open): both pass; a finite wrong
    answer does not."""
    inputs, attributes = _one_query(np.zeros((2, 1)), np.full((2, 1), 3e38))
    assert np.isinf(multi_head_attention(**inputs, **attributes)).all()
    assert _judged(inputs, attributes, [[[3e38]]]) == []
    assert _judged(inputs, attributes, [[[np.inf]]]) == []
    assert _judged(inputs, attributes, [[[1e38]]])


def test_a_dot_product_that_overflows_in_one_order_and_not_another_passes_either_way():
    """q . k = 3e38 + 3e38 - 3e38 - 3e38: the reference's order overflows (a NaN row); another gives 0, exactly, and
    the row [2.46, ...] of the exact softmax. Both pass (the order is free); a row far from the exact one fails only
    where its bound, which the overflowing scores make huge, says so."""
    key = np.array([[3e38, 3e38, -3e38, -3e38], [0, 0, 0, 0]])
    inputs, attributes = _one_query(key, np.array([[1.0] * 4, [3.0] * 4]))
    assert np.isnan(multi_head_attention(**inputs, **attributes)).all()
    assert _judged(inputs, attributes, np.full((1, 1, 4), 2.0)) == []  # the exact row: 1 and 3 equally weighted
    assert _judged(inputs, attributes, np.full((1, 1, 4), np.nan)) == []
    assert _judged(inputs, attributes, np.full((1, 1, 4), 1e35))  # the bound here is about 8e33


def test_a_fully_masked_row_with_a_nan_score_is_nan_not_zero():
    """Spec: a NaN score is not -inf, even under a -inf mask entry; a backend that skips masked keys (zero row)
    fails."""
    inputs, attributes = _one_query(np.ones((2, 2)), np.ones((2, 2)))
    inputs["query"][0, 0, 0] = np.nan
    inputs["attn_mask"] = np.full((1, 2), -np.inf, np.float32)
    assert np.isnan(multi_head_attention(**inputs, **attributes)).all()
    assert _judged(inputs, attributes, np.zeros((1, 1, 2)))
    assert _judged(inputs, attributes, np.full((1, 1, 2), np.nan)) == []


def test_the_fused_ops_rows_past_float32_range_are_judged_against_the_exact_value():
    """MultiHeadCacheAttention: a decode over a history of values 3e38 under equal scores (the exact output 3e38;
    the reference's sum overflows): a backend dividing first passes, as does inf; a finite wrong answer fails."""
    from kvcache_op.validation.cases import Seq
    from kvcache_op.validation.compare import compare
    from kvcache_op.validation.mhca_cases import build_cache_attention
    from kvcache_op.validation.outcome import Outcome, reference_outcome

    case = build_cache_attention("range", [Seq(3, 1)], heads=1, head_dim=1, group=1, t1="float32", cache_mode=0)
    case.inputs["query"][:] = 0.0  # equal scores
    case.inputs["cache"][:, 0, 1] = 3e38  # layout 0 (MaxT, L, 2, H, Dh): every value row
    case.inputs["current_value"][:] = 3e38
    want = reference_outcome("MultiHeadCacheAttention", case.inputs, case.attributes)
    assert np.isinf(want.outputs["output"]).all()
    for answer, passes in ((3e38, True), (np.inf, True), (1e38, False)):
        got = Outcome(outputs={"output": np.full((1, 1, 1), answer, np.float32)}, after=dict(want.after),
                      tolerance=want.tolerance)
        assert (compare("MultiHeadCacheAttention", case.inputs, case.attributes, want, got, "spec") == []) == passes


def test_padding_keys_masked_with_the_lowest_finite_value_keep_the_row_in_range():
    """torch.finfo(float32).min on padding keys (Hugging Face's mask) does not put a row past float32's range while
    a key with an ordinary score remains: NaN or inf there fails as in any row. A row whose every key is so masked
    is past the range (its largest score is -3.4e38, which a backend's rescaling may take to -inf)."""
    inputs, attributes = _one_query(np.ones((3, 2)), np.arange(6.0).reshape(3, 2))
    inputs["attn_mask"] = np.array([[0.0, np.finfo(np.float32).min, np.finfo(np.float32).min]], np.float32)
    want = multi_head_attention(**inputs, **attributes)
    assert _judged(inputs, attributes, want) == []
    assert _judged(inputs, attributes, np.full((1, 1, 2), np.nan))
    inputs["attn_mask"][0, 0] = np.finfo(np.float32).min
    from kvcache_op.reference import attention_exact

    assert attention_exact(**inputs, **attributes)[1].all()
