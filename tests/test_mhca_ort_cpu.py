"""The MultiHeadCacheAttention CPU kernel through ONNX Runtime, held to oracles written apart from it: the naive
KeyValueCache (the cache after the call, bit for bit) then the naive float64 attention (the output within the
spec's bound). Long decodes split over their keys (the log-sum-exp merge) match the reference and do not depend
on the thread count; invalid calls and overlapping buffers are refused with the cache unchanged; ppl.pmx's 11-,
12- and 13-input nodes run."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_kernels import CPU_KERNELS, use_cpu_kernel
from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import cache_attention_tolerance, multi_head_cache_attention
from kvcache_op.validation.cases import Seq
from kvcache_op.validation.mhca_cases import CASES, build_cache_attention
from naive_attention import naive_attention
from naive_reference import naive_key_value_cache
from processes import run_script
from ort_helpers import copies
from test_mha_reference import assert_within
from test_mhca_reference import _split, cache_attention_calls
from test_ort_output_aliasing import bind
from kvcache_op.reference import attention_error_bound


def ort_call(inputs, attributes, threads=1):
    """(output, cache after, scale after) of the ORT op on copies of ``inputs``."""
    fresh = copies(inputs)
    model = spec.make_cache_attention_model(fresh, **attributes)
    session = make_session(model, intra_op_num_threads=threads)
    (out,) = run_model(model, {k: v for k, v in fresh.items() if v is not None}, session=session)
    return out, fresh["cache"], fresh["scale"]


def naive_oracle(inputs, attributes):
    """(exact output, bound, cache after, scale after) from the naive KeyValueCache and the naive attention."""
    cache_attrs, attention = _split(attributes)
    key, value, cache_after, scale_after = naive_key_value_cache(
        inputs["current_key"], inputs["current_value"], inputs["seqstarts"], inputs["kvstarts"],
        inputs["cachestarts"], inputs["start_pos"], inputs["cache"], inputs["scale"], **cache_attrs)
    exact, n, v_max, a_mean = naive_attention(inputs["query"], key, value, inputs["seqstarts"], inputs["kvstarts"],
                                              inputs["decoding_batches"], inputs.get("attn_mask"), **attention)
    bound = np.where(n > 0, attention_error_bound(n, v_max, a_mean, attention["head_dim"], inputs["query"].dtype), 0.0)
    return exact, bound, cache_after, scale_after


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
@given(cache_attention_calls(), st.sampled_from((1, 2)))
def test_ort_writes_the_naive_cache_and_is_within_the_bound_of_the_exact_attention(call, threads):
    inputs, attributes = call
    exact, bound, cache_after, scale_after = naive_oracle(inputs, attributes)
    out, cache, scale = ort_call(inputs, attributes, threads)
    assert out.dtype == inputs["query"].dtype and out.shape == inputs["query"].shape
    assert cache.tobytes() == cache_after.tobytes()
    if scale_after is not None:
        assert scale.tobytes() == scale_after.tobytes()
    assert_within(out, exact, bound, "ORT")
    assert np.all(out[bound == 0] == 0), "a row without an effective key must be exactly zero"


def long_decode(t1="float16", quant_bit=0, cache_layout=0, head_dim=64, **kw):
    """Decodes with thousands of keys (split over their keys: too few tasks otherwise), GQA group 4, beside a
    short prefill chunk; paged."""
    seqs = [Seq(2999, 1), Seq(1800, 1), Seq(40, 24)]
    return build_cache_attention(f"long-{t1}-{quant_bit}-{cache_layout}", seqs, heads=2, head_dim=head_dim, group=4,
                                 cache_mode=1, page_size=64, t1=t1, quant_bit=quant_bit, cache_layout=cache_layout,
                                 **kw)


@pytest.mark.parametrize("t1, quant_bit, layout, head_dim", [
    ("float16", 0, 0, 64), ("float32", 0, 3, 64), ("bfloat16", 8, 3, 64), ("float16", 4, 1, 64),
    ("float32", 0, 1, 128),  # key and value rows of 1 KiB side by side: read key by key
    ("float16", 8, 0, 128)])
def test_long_decodes_split_over_their_keys_match_the_reference_whatever_the_threads(t1, quant_bit, layout, head_dim):
    case = long_decode(t1, quant_bit, layout, head_dim, sliding_window=2500 if layout else 0, is_alibi=int(layout == 3),
                       mask=layout == 1)
    want = multi_head_cache_attention(**copies(case.inputs), **case.attributes)
    tolerance = 2 * cache_attention_tolerance(**case.inputs, **case.attributes)
    one = ort_call(case.inputs, case.attributes, 1)[0]
    assert_within(one, want.astype(np.float64), tolerance, "ORT, 1 thread")
    assert ort_call(case.inputs, case.attributes, 2)[0].tobytes() == one.tobytes()  # tasks do not follow threads


@pytest.mark.parametrize("head_dim", [16, 128])  # 128: a slot's 512-byte key row, read key by key
def test_a_split_decode_keeps_non_finite_scores_as_one_pass_does(head_dim):
    """A NaN key in one key range makes the output NaN; keys hidden by a -inf mask in a whole key range are
    skipped (that range sees no key); a row hidden everywhere stays exactly zero."""
    case = build_cache_attention("split-nonfinite", [Seq(2047, 1), Seq(2047, 1), Seq(2047, 1)], heads=1,
                                 head_dim=head_dim, group=2, cache_mode=0, t1="float32", mask=True)
    i = dict(case.inputs)
    mask = i["attn_mask"]
    mask[1, 2048:2048 + 1500] = -np.inf  # sequence 1: most of its keys hidden, several key ranges wholly
    mask[2, 4096:4096 + 2048] = -np.inf  # sequence 2: every key hidden
    cache = i["cache"]
    cache.reshape(-1)[:1] = np.nan  # slot 0, key head 0: the first key of sequence 0
    want = multi_head_cache_attention(**copies(i), **case.attributes)
    got = ort_call(i, case.attributes, 2)[0]
    assert np.isnan(want[0]).all() and np.isnan(got[0]).all()
    assert np.all(got[2] == 0) and np.all(want[2] == 0)
    tolerance = 2 * cache_attention_tolerance(**i, **case.attributes)
    assert_within(got[1], want[1].astype(np.float64), tolerance[1], "partly hidden")


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases_match_the_reference_cache_bit_for_bit_and_output_within_its_bound(name):
    case = CASES[name]()
    fresh = copies(case.inputs)
    want = multi_head_cache_attention(**fresh, **case.attributes)
    out, cache, scale = ort_call(case.inputs, case.attributes, 2)
    assert cache.tobytes() == fresh["cache"].tobytes()
    assert scale is None or scale.tobytes() == fresh["scale"].tobytes()
    assert_within(out, want.astype(np.float64), 2 * cache_attention_tolerance(**case.inputs, **case.attributes), name)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_key_by_key_decodes_with_alibi_softcap_and_a_mask_match_the_reference(monkeypatch, kernel):
    """Slots whose key and value rows lie together and are long are read key by key, the heads' softmax steps
    side by side: ALiBi, softcap, a mask with -inf entries, a window."""
    use_cpu_kernel(monkeypatch, kernel)
    case = long_decode("float16", 0, 0, 256, is_alibi=1, softcap=5.0, mask=True, sliding_window=1500)
    inputs = copies(case.inputs)
    inputs["attn_mask"][0, 1500:1800] = -np.inf  # the window's first keys: weight 0 while the max is -inf
    want = multi_head_cache_attention(**copies(inputs), **case.attributes).astype(np.float64)
    tolerance = 2 * cache_attention_tolerance(**inputs, **case.attributes)
    assert_within(ort_call(inputs, case.attributes)[0], want, tolerance, f"{kernel} build")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit, layout", [(8, 0), (0, 3), (4, 1)])
def test_every_build_is_within_the_bound(monkeypatch, kernel, quant_bit, layout):
    """Split decodes and a prefill chunk of 24 queries (tiled products) over paged, quantized or head-major
    caches."""
    use_cpu_kernel(monkeypatch, kernel)
    case = long_decode("float16", quant_bit, layout, head_dim=64, mask=True)
    want = multi_head_cache_attention(**copies(case.inputs), **case.attributes).astype(np.float64)
    tolerance = 2 * cache_attention_tolerance(**case.inputs, **case.attributes)
    assert_within(ort_call(case.inputs, case.attributes)[0], want, tolerance, f"{kernel} build")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("t1, quant_bit, layout", [("float16", 0, 0), ("float32", 8, 3)])
def test_short_chunks_over_long_caches_split_over_their_keys_match_the_reference(monkeypatch, kernel, t1, quant_bit,
                                                                                  layout):
    """Sequences of 2-4 queries (speculative decoding, short chunks) over thousands of cached keys are split over
    their keys as decodes are, each query row with partial results of its own: causal, so each row sees a different
    last key, and the merge must keep the rows' partial softmaxes apart."""
    use_cpu_kernel(monkeypatch, kernel)
    case = build_cache_attention("split-chunks", [Seq(2000, 3), Seq(1500, 2), Seq(700, 4)], heads=2, head_dim=64,
                                 group=4, cache_mode=1, page_size=64, t1=t1, quant_bit=quant_bit,
                                 cache_layout=layout, sliding_window=1800 if layout else 0)
    want = multi_head_cache_attention(**copies(case.inputs), **case.attributes).astype(np.float64)
    tolerance = 2 * cache_attention_tolerance(**case.inputs, **case.attributes)
    one = ort_call(case.inputs, case.attributes, 1)[0]
    assert_within(one, want, tolerance, f"{kernel} build, 1 thread")
    assert ort_call(case.inputs, case.attributes, 2)[0].tobytes() == one.tobytes()


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("quant_bit", [8, 4])
@pytest.mark.parametrize("quant_group", [16, 32])
def test_decodes_over_caches_quantized_in_groups_of_16_and_32_match_the_reference(monkeypatch, kernel, quant_bit,
                                                                                    quant_group):
    """The decode tiles dequantize codes in registers for groups of 8 only; a cache quantized in larger groups
    (whole vectors of a head of 64 or 128) must take the row-by-row dequantization, each group its own scale."""
    use_cpu_kernel(monkeypatch, kernel)
    for head_dim in (64, 128):
        case = build_cache_attention(f"group{quant_group}", [Seq(700, 1), Seq(40, 1), Seq(9, 3)], heads=2,
                                     head_dim=head_dim, group=2, cache_mode=1, page_size=16, t1="float16",
                                     quant_bit=quant_bit, quant_group=quant_group)
        want = multi_head_cache_attention(**copies(case.inputs), **case.attributes).astype(np.float64)
        tolerance = 2 * cache_attention_tolerance(**case.inputs, **case.attributes)
        got = ort_call(case.inputs, case.attributes, 2)[0]
        assert_within(got, want, tolerance, f"{kernel} build, int{quant_bit} in groups of {quant_group}, "
                                            f"head_dim {head_dim}")


@pytest.mark.parametrize("seqs", [[Seq(5, 1), Seq(2, 1), Seq(0, 7), Seq(3, 3)], [Seq(900, 1), Seq(600, 1)]])
def test_a_per_head_attn_mask_under_gqa_matches_the_reference(seqs):
    """A rank-3 attn_mask (num_heads, tokens, >= kv_tokens) under GQA: each query head reads its own plane, not
    its key head's. Decodes, a prefill of 7 and a chunk of 3; the long decodes split over their keys."""
    case = build_cache_attention("mask3-gqa", seqs, heads=2, head_dim=32, group=4, cache_mode=1, page_size=16,
                                 decoding=2, mask=3)
    inputs = copies(case.inputs)
    assert inputs["attn_mask"].shape[0] == case.attributes["num_heads"] == 8
    inputs["attn_mask"] *= 4  # planes far apart: a head reading its key head's plane is well outside the bound
    want = multi_head_cache_attention(**copies(inputs), **case.attributes).astype(np.float64)
    tolerance = 2 * cache_attention_tolerance(**inputs, **case.attributes)
    assert_within(ort_call(inputs, case.attributes, 2)[0], want, tolerance, "ORT, a mask plane per head")


@pytest.mark.parametrize("target", ["cache", "query"])
def test_an_output_bound_onto_an_input_is_refused_and_the_cache_kept(target):
    case = CASES["mhca_paged_gqa2"]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    session = make_session(spec.make_cache_attention_model(case.inputs, **case.attributes))
    query = feeds["query"]
    before = feeds["cache"].tobytes(), query.tobytes()
    binding, keep = bind(session, feeds, {"output": (feeds[target], query.shape, query.dtype)})
    with pytest.raises(Exception, match=f"output overlaps {target}"):
        session.run_with_iobinding(binding)
    assert (feeds["cache"].tobytes(), query.tobytes()) == before
    del keep


def test_a_query_sharing_the_caches_memory_is_refused_before_the_store():
    """The stores come first: a query inside the cache would be overwritten before it is read."""
    case = CASES["mhca_offset_float16"]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    flat = feeds["cache"].reshape(-1)
    feeds["query"] = flat[:feeds["query"].size].reshape(feeds["query"].shape)  # a view into the cache
    session = make_session(spec.make_cache_attention_model(case.inputs, **case.attributes))
    out = np.empty(feeds["query"].shape, feeds["query"].dtype)
    before = feeds["cache"].tobytes()
    binding, keep = bind(session, feeds, {"output": (out, out.shape, out.dtype)})
    with pytest.raises(Exception, match="cache overlaps query"):
        session.run_with_iobinding(binding)
    assert feeds["cache"].tobytes() == before
    del keep


@pytest.mark.parametrize("name, target", [("mhca_empty_scale_mask", "cache"), ("mhca_mask_minus_inf", "scale")])
def test_an_attn_mask_sharing_the_caches_or_scales_memory_is_refused_before_the_store(name, target):
    """The stores come first: an attn_mask inside the cache (or the scale) would be overwritten before the
    attention reads it."""
    case = CASES[name]()
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    mask = feeds["attn_mask"]
    flat = feeds[target].reshape(-1).view(np.uint8).view(mask.dtype)
    assert flat.size >= mask.size
    feeds["attn_mask"] = flat[:mask.size].reshape(mask.shape)  # a view into the cache / scale
    session = make_session(spec.make_cache_attention_model(case.inputs, **case.attributes))
    out = np.empty(feeds["query"].shape, feeds["query"].dtype)
    before = feeds["cache"].tobytes(), feeds["scale"].tobytes()
    binding, keep = bind(session, feeds, {"output": (out, out.shape, out.dtype)})
    with pytest.raises(Exception, match=f"{target} overlaps attn_mask"):
        session.run_with_iobinding(binding)
    assert (feeds["cache"].tobytes(), feeds["scale"].tobytes()) == before
    del keep


@pytest.mark.parametrize("change, message", [
    (lambda i: i.update(start_pos=i["start_pos"] + 10**6), "cachestarts"),
    (lambda i: i.update(decoding_batches=np.array(9, np.int64)), "decoding_batches = 9 must be in"),
    (lambda i: i.update(attn_mask=np.zeros((1, 1), i["query"].dtype)), "attn_mask must have shape"),
])
def test_an_invalid_call_is_refused_with_the_references_message_and_the_cache_unchanged(change, message):
    case = CASES["mhca_paged_int8_layout3"]()
    inputs = copies(case.inputs)
    change(inputs)
    with pytest.raises(Exception, match=message):
        multi_head_cache_attention(**copies(inputs), **case.attributes)
    model = spec.make_cache_attention_model(inputs, **case.attributes)
    before = inputs["cache"].tobytes(), inputs["scale"].tobytes()
    with pytest.raises(Exception, match=message):
        run_model(model, {k: v for k, v in inputs.items() if v is not None})
    assert (inputs["cache"].tobytes(), inputs["scale"].tobytes()) == before


@pytest.mark.parametrize("softcap, message", [(float("nan"), r"softcap must be finite and >= 0 \(0: off\), got nan"),
                                              (-1.0, r"softcap must be finite and >= 0 \(0: off\), got -1")])
def test_an_invalid_softcap_fails_when_the_session_is_made(softcap, message):
    case = CASES["mhca_paged_gqa2"]()
    with pytest.raises(Exception, match=message):
        make_session(spec.make_cache_attention_model(case.inputs, **case.attributes, softcap=softcap))


def test_a_constant_cache_is_refused_when_the_session_is_made():
    from onnx import numpy_helper

    case = CASES["mhca_offset_float16"]()
    model = spec.make_cache_attention_model(case.inputs, **case.attributes)
    cache = case.inputs["cache"]
    model.graph.initializer.append(numpy_helper.from_array(cache, "cache"))
    model.graph.input.remove([v for v in model.graph.input if v.name == "cache"][0])
    with pytest.raises(ValueError, match="cache 'cache' is an initializer, but the op writes it in place"):
        make_session(model)  # the session helpers' graph rule
    import onnxruntime as ort

    from kvcache_op.ort_ops import session_options

    with pytest.raises(Exception, match="cache is a constant initializer"):  # the kernel's own, without the helpers
        ort.InferenceSession(model.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])


def test_a_node_with_num_repeat_other_than_1_is_refused_by_the_kernel_itself():
    """MultiHeadCacheAttention stores as KeyValueCache with num_repeat 1 and has no such attribute: the session
    helpers refuse it by name, and a plain onnxruntime session with the library registered is refused by the
    kernel itself rather than run as if it were 1."""
    import onnx
    import onnxruntime as ort

    from kvcache_op.ort_ops import session_options

    case = CASES["mhca_paged_gqa2"]()
    model = spec.make_cache_attention_model(copies(case.inputs), **case.attributes)
    (node,) = model.graph.node
    node.attribute.append(onnx.helper.make_attribute("num_repeat", 2))
    feeds = {k: v for k, v in copies(case.inputs).items() if v is not None}
    with pytest.raises(Exception, match="num_repeat must be 1"):
        session = ort.InferenceSession(model.SerializeToString(), session_options(1),
                                       providers=["CPUExecutionProvider"])
        session.run(None, feeds)


@pytest.mark.parametrize("form", ["11 inputs", "12 inputs, int8 scale", "13 inputs, empty scale and a mask"])
def test_ppl_pmx_node_forms_run(form):
    """ppl.pmx writes 11 inputs without a scale or a mask, 12 with a scale, 13 with a mask (an empty scale
    tensor standing in when the cache is not quantized)."""
    if form.startswith("12"):
        case = CASES["mhca_paged_int8_layout3"]()
    else:
        case = build_cache_attention("ppl-forms", [Seq(3, 1), Seq(0, 4)], cache_mode=1, page_size=4,
                                     mask=form.startswith("13"))
    inputs = copies(case.inputs)
    if form.startswith("13"):
        inputs["scale"] = np.zeros((0,), np.float16)
    model = spec.make_cache_attention_model(inputs, **case.attributes)
    assert len(model.graph.node[0].input) == int(form[:2])
    want = multi_head_cache_attention(**copies(case.inputs), **case.attributes)
    (got,) = run_model(model, {k: v for k, v in inputs.items() if v is not None})
    assert_within(got, want.astype(np.float64), 2 * cache_attention_tolerance(**case.inputs, **case.attributes), form)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("t1, head_dim, group, quant_bit", [
    ("float16", 128, 3, 0),  # runs of 2 and 1 heads: a one-head run's key tiles are the longest
    ("float32", 64, 1, 0),   # no grouping: every run one head
    ("float16", 128, 4, 8),  # int8 rows, dequantized part by part
    ("float16", 64, 3, 0)])  # rows under 256 bytes: one part per block
def test_decode_blocks_computed_in_parts_match_the_reference(monkeypatch, kernel, t1, head_dim, group, quant_bit):
    """Decodes over long rows run each block's dot products in parts of keys; key counts that end blocks and
    parts early, and head runs whose tiles span more keys than a part of 8, leave every head's scores its own."""
    use_cpu_kernel(monkeypatch, kernel)
    seqs = [Seq(70, 1), Seq(45, 1), Seq(33, 1), Seq(9, 1), Seq(100, 1)]
    case = build_cache_attention(f"parts-{t1}-{head_dim}-{group}", seqs, heads=2, head_dim=head_dim, group=group,
                                 cache_mode=1, page_size=16, t1=t1, quant_bit=quant_bit)
    want = multi_head_cache_attention(**copies(case.inputs), **case.attributes).astype(np.float64)
    tolerance = 2 * cache_attention_tolerance(**case.inputs, **case.attributes)
    assert_within(ort_call(case.inputs, case.attributes)[0], want, tolerance, f"{kernel} build")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("t3", ["float16", "float32"])
@pytest.mark.parametrize("t1, quant_bit, layout", [
    ("float16", 8, 0), ("float16", 4, 3), ("bfloat16", 8, 2), ("bfloat16", 4, 1), ("float32", 8, 0)])
def test_decode_reads_codes_exactly_as_the_gather_gives_them(monkeypatch, kernel, t1, quant_bit, layout, t3):
    """A zero query weighs every key 1, so each output is the float32 running sum of the gathered value rows,
    key by key, over their count: bit for bit what the kernel must give if it reads each value as
    KeyValueCache's gather gives it (code x scale rounded to T1), with float16 or float32 scales. Values left
    unrounded, or a group given its neighbour's scale, would differ."""
    use_cpu_kernel(monkeypatch, kernel)
    seqs = [Seq(4, 1), Seq(40, 1), Seq(7, 1)]
    case = build_cache_attention(f"exact-codes-{t1}-{quant_bit}-{layout}", seqs, heads=2, head_dim=64, group=2,
                                 cache_mode=1, page_size=8, t1=t1, t3=t3, quant_bit=quant_bit, cache_layout=layout)
    inputs = copies(case.inputs)
    inputs["query"][:] = 0
    cache_attrs, _ = _split(case.attributes)
    _, value, _, _ = naive_key_value_cache(
        inputs["current_key"], inputs["current_value"], inputs["seqstarts"], inputs["kvstarts"],
        inputs["cachestarts"], inputs["start_pos"], inputs["cache"], inputs["scale"], **cache_attrs)
    group = case.attributes["num_heads"] // case.attributes["num_kv_heads"]
    want = np.empty_like(inputs["query"])
    for b in range(len(seqs)):
        rows = value[inputs["kvstarts"][b]:inputs["kvstarts"][b + 1]].astype(np.float32)
        total = np.zeros(rows.shape[1:], np.float32)
        for row in rows:  # in key order, float32, as the kernel accumulates
            total = total + row
        mean = total / np.float32(len(rows))
        want[inputs["seqstarts"][b]] = np.repeat(mean, group, axis=0).astype(want.dtype)
    got = ort_call(inputs, case.attributes)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("queries", [2, 4])
@pytest.mark.parametrize("hidden", [400, None])
def test_a_split_chunk_keeps_a_non_finite_value_under_a_wholly_masked_key_range(monkeypatch, kernel, queries, hidden):
    """A chunk of 2-4 queries over a long cache is split over its keys. One key range hidden entirely by -inf mask
    entries still holds a NaN value, whose key enters the sums with weight 0: the merged row is NaN in that column,
    as in one pass (the range's part had dropped the value, giving a finite row). A row the mask hides everywhere
    (``hidden`` None: padding) is zero, NaN value or not."""
    use_cpu_kernel(monkeypatch, kernel)
    case = build_cache_attention("split-masked-range", [Seq(1000, queries)], heads=1, head_dim=16, group=1,
                                 t1="float32", mask=True, cache_mode=0)
    inputs = copies(case.inputs)
    inputs["attn_mask"][:, :hidden] = -np.inf  # 400: more than a whole key range of the split
    inputs["cache"][5, 0, 1, 0, 3] = np.nan  # layout 0 (MaxT, L, 2, H, Dh): the value row of position 5
    want = multi_head_cache_attention(**copies(inputs), **case.attributes)
    got = ort_call(inputs, case.attributes)[0]
    if hidden is None:
        assert np.all(want == 0) and np.all(got == 0), got
        return
    assert np.isnan(want[:, 0, 3]).all() and np.isnan(got[:, 0, 3]).all(), got[:, 0, 3]
    tolerance = 2 * cache_attention_tolerance(**inputs, **case.attributes)
    assert_within(got, want.astype(np.float64), tolerance, f"{kernel} build")


def test_a_call_that_cannot_save_the_rows_it_overwrites_is_refused_naming_the_memory():
    """The rows a call's stores overwrite are saved before the stores (put back should the call fail after them).
    When that copy cannot be allocated, the call fails before any store, naming what it could not get."""
    script = """
        import resource
        import numpy as np
        from kvcache_op import spec
        from kvcache_op.ort_ops import make_session, run_model

        tokens, heads, dim = 1 << 14, 16, 128  # 64 MiB of float16 keys and as much of values: 128 MiB of rows to save
        rng = np.random.default_rng(0)
        cache = np.zeros((tokens, 1, 2, heads, dim), np.float16)
        one = lambda v: np.array([v], np.int64)
        inputs = dict(query=np.ones((tokens, heads, dim), np.float16),
                      current_key=rng.standard_normal((tokens, heads, dim)).astype(np.float16),
                      current_value=rng.standard_normal((tokens, heads, dim)).astype(np.float16),
                      seqstarts=np.array([0, tokens], np.int64), kvstarts=np.array([0, tokens], np.int64),
                      cachestarts=one(0), start_pos=one(0), decoding_batches=one(0), max_seqlen=one(tokens),
                      max_kvlen=one(tokens), cache=cache)
        attributes = dict(num_heads=heads, head_dim=dim, num_kv_heads=heads, cache_mode=0, cache_layout=0)
        model = spec.make_cache_attention_model(inputs, **attributes)
        session = make_session(model, intra_op_num_threads=1)
        before = cache.copy()
        with open("/proc/self/status") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        # room for the 64 MiB output, not for the 128 MiB of rows to save as well
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (100 << 20), hard))
        try:
            run_model(model, inputs, session=session)
        except Exception as error:
            message = str(error)
        else:
            raise AssertionError("the call ran")
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        assert "out of memory for saving the cache rows its 16384 stored tokens overwrite" in message, message
        assert "nothing was written" in message, message
        assert cache.tobytes() == before.tobytes()
        print("ok")
    """
    child = run_script(script)
    assert child.returncode == 0 and "ok" in child.stdout, (child.returncode, child.stdout, child.stderr[-2000:])


def test_a_call_whose_attention_cannot_get_its_memory_leaves_the_cache_unchanged():
    """A page table may name one read-only page at every position, so a 2-page cache can hold a sequence of 2^40
    keys: the attention's working memory for them cannot be allocated, which happens after the call's stores. The
    call fails naming the memory, and the stored rows are put back: the cache is unchanged."""
    script = """
        import resource
        import numpy as np
        from kvcache_op import spec
        from kvcache_op.ort_ops import make_session, run_model

        page, keys = 1 << 16, 1 << 40
        table = np.zeros((1, keys // page), np.int64)  # every page the shared one, but the last
        table[0, -1] = page  # the page the call stores into
        cache = np.zeros((2 * page, 1, 2, 1, 2), np.float16)
        cache[:page] = 1.0
        one = lambda v: np.array([v], np.int64)
        inputs = dict(query=np.ones((1, 1, 2), np.float16), current_key=np.full((1, 1, 2), 7, np.float16),
                      current_value=np.full((1, 1, 2), 9, np.float16), seqstarts=np.array([0, 1], np.int64),
                      kvstarts=np.array([0, keys], np.int64), cachestarts=table, start_pos=one(keys - 1),
                      decoding_batches=one(0), max_seqlen=one(1), max_kvlen=one(keys), cache=cache)
        attributes = dict(num_heads=1, head_dim=2, num_kv_heads=1, cache_mode=1, page_size=page, cache_layout=0)
        model = spec.make_cache_attention_model(inputs, **attributes)
        session = make_session(model, intra_op_num_threads=1)
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # the working memory: over 100 GiB
        before = cache.copy()
        try:
            run_model(model, inputs, session=session)
        except Exception as error:
            assert "out of memory for the attention's working memory" in str(error), error
            assert "cache and scale are unchanged" in str(error), error
        else:
            raise AssertionError("the call ran")
        assert cache.tobytes() == before.tobytes(), np.argwhere(cache != before)[:4]
        print("ok")
    """
    child = run_script(script)
    assert child.returncode == 0 and "ok" in child.stdout, (child.returncode, child.stdout, child.stderr[-2000:])
