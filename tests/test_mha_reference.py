"""The MultiHeadAttention reference against an independent float64 oracle (within the spec's bound), against
torch's scaled_dot_product_attention when torch is installed, and on the spec's worked examples."""

import numpy as np
import pytest
from hypothesis import given, settings

from attention_strategies import attention_calls
from kvcache_op.reference import (BFLOAT16, MultiHeadAttentionError, alibi_slopes, attention_error_bound,
                                  attention_exact, attention_tolerance, multi_head_attention)
from kvcache_op.validation.mha_cases import ATTENTION_CASES, build_attention
from naive_attention import naive_attention, paper_slopes


def oracle(case):
    """(exact output, bound of every element) from the naive oracle."""
    i, a = case.inputs, case.attributes
    exact, n, v_max, a_mean = naive_attention(i["query"], i["key"], i["value"], i["seqstarts"], i["kvstarts"],
                                             i["decoding_batches"], i["attn_mask"], **a)
    bound = np.where(n > 0, attention_error_bound(n, v_max, a_mean, a["head_dim"], i["query"].dtype), 0.0)
    return exact, bound


def assert_within(got, exact, bound, what):
    """Every element within its bound of the exact result; in a row (query, head) where the exact result is not
    finite, the spec leaves open whether each such element is NaN or an infinity and whether others are non-finite
    too: each is non-finite, and the elements finite on both sides (with a finite bound) are within it."""
    got = np.asarray(got).astype(np.float64)
    if got.ndim:
        open_rows = ~np.isfinite(exact).all(axis=-1, keepdims=True)
        missed = np.isfinite(got) & ~np.isfinite(exact) | np.isinf(got) & np.isinf(exact) & (got != exact)
        at = tuple(np.argwhere(missed)[0]) if missed.any() else None
        assert at is None, f"{what}: {at} is {got[at]}, where the exact result is {exact[at]}"
        checked = ~open_rows | (np.isfinite(got) & np.isfinite(exact) & np.isfinite(bound))
    else:
        checked = np.ones((), bool)
    with np.errstate(invalid="ignore"):
        error = np.where(checked, np.abs(got - exact), 0.0)
        over = checked & ~(error <= bound)
    worst = tuple(np.argwhere(over)[0]) if over.any() else None
    assert worst is None, f"{what}: |error| {error[worst]} > bound {bound[worst]} at {worst}"


@settings(max_examples=2 * settings.default.max_examples)  # twice the profile's: the main property
@given(attention_calls())
def test_reference_is_within_the_bound_of_the_exact_result(case):
    exact, bound = oracle(case)
    got = multi_head_attention(**case.inputs, **case.attributes)
    assert got.dtype == case.inputs["query"].dtype and got.shape == case.inputs["query"].shape
    assert_within(got, exact, bound, "reference")
    assert np.all(got[bound == 0] == 0), "a row without an effective key must be exactly zero"


@given(attention_calls(dtypes=("float32",)))
def test_reference_tolerance_is_the_oracles(case):
    """attention_tolerance (the reference's n, V, A) and the oracle's agree."""
    _, bound = oracle(case)
    np.testing.assert_allclose(attention_tolerance(**case.inputs, **case.attributes), bound, rtol=1e-6, atol=0)


@given(attention_calls())
def test_attention_exact_is_the_oracles_exact_result(case):
    """attention_exact (the kit's float64 evaluation for rows outside float32's range) agrees with the oracle's o*;
    no drawn call leaves float32's range."""
    exact, _ = oracle(case)
    got, out_of_range = attention_exact(**case.inputs, **case.attributes)
    np.testing.assert_allclose(got, exact, rtol=1e-9, atol=1e-300)
    assert not out_of_range.any()


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_named_cases_are_within_float32_range(name):
    """The vectors' recorded bound holds in every row of every named case (none outside float32's range)."""
    case = ATTENTION_CASES[name]()
    assert not attention_exact(**case.inputs, **case.attributes)[1].any()


def test_rows_past_float32_range_are_found():
    """A value column whose n * V reaches 2^126, or a dot product whose terms do, puts its row outside the range."""
    case = build_attention("range", [(1, 4), (1, 4)], heads=1, head_dim=2, t="float32", decoding=2)
    assert not attention_exact(**case.inputs, **case.attributes)[1].any()
    case.inputs["value"][1, 0, 1] = 2.0**125  # sequence 0: 4 keys, n * V = 2^127
    case.inputs["query"][1, 0, 0], case.inputs["key"][6, 0, 0] = 1.0, 2.0**126  # sequence 1: a term of 2^126
    assert attention_exact(**case.inputs, **case.attributes)[1].tolist() == [[True], [True]]


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_named_cases_are_within_the_bound(name):
    case = ATTENTION_CASES[name]()
    exact, bound = oracle(case)
    assert_within(multi_head_attention(**case.inputs, **case.attributes), exact, bound, name)


def test_the_bound_is_tight_enough_to_catch_a_wrong_visibility():
    """Dropping the causal rule, or aligning it to the start of the keys, is far outside the bound."""
    case = build_attention("wrong", [(3, 7)], t="float16")
    exact, bound = oracle(case)
    not_causal = multi_head_attention(**case.inputs, **dict(case.attributes, is_causal=0))
    assert np.any(np.abs(not_causal.astype(np.float64) - exact) > bound)
    short = build_attention("wrong", [(3, 3)], t="float16")  # the same queries over the first 3 keys only
    start_aligned = multi_head_attention(**dict(short.inputs, query=case.inputs["query"]), **case.attributes)
    assert np.any(np.abs(start_aligned.astype(np.float64) - exact) > bound)


def test_alibi_slopes_are_the_papers():
    for heads in (1, 2, 3, 5, 6, 8, 12, 16, 20, 32, 40):
        np.testing.assert_array_equal(alibi_slopes(heads), np.array(paper_slopes(heads), np.float32))
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


def worked_example(**attrs):
    """The spec's worked example: D = 1, a decode (kvlen 3) and a chunk of 2 queries over 4 keys."""
    z = np.zeros((3, 1, 1), np.float32)
    value = np.array([1, 2, 3, 10, 20, 30, 40], np.float32).reshape(7, 1, 1)
    return multi_head_attention(z, np.zeros((7, 1, 1), np.float32), value, np.array([0, 1, 3]), np.array([0, 3, 7]),
                                np.array(1), np.array(2), np.array(4), num_heads=1, head_dim=1, **attrs)[:, 0, 0]


def test_spec_worked_examples():
    assert worked_example().tolist() == [2, 20, 25]
    assert worked_example(sliding_window=2).tolist() == [2.5, 25, 35]
    assert worked_example(is_causal=0).tolist() == [2, 25, 25]
    empty = multi_head_attention(np.ones((1, 2, 4), np.float16), np.zeros((0, 2, 4), np.float16),
                                 np.zeros((0, 2, 4), np.float16), np.array([0, 1]), np.array([0, 0]), np.array(0),
                                 np.array(1), np.array(0), num_heads=2, head_dim=4)
    assert empty.tolist() == [[[0.0] * 4] * 2]


def test_fully_masked_row_is_zero_not_nan():
    case = ATTENTION_CASES["mha_fully_masked_rows"]()
    out = multi_head_attention(**case.inputs, **case.attributes)
    assert not np.isnan(out.astype(np.float32)).any()
    assert np.all(out[0] == 0) and np.all(out[2] == 0) and np.all(out[4] == 0)  # all -inf; kvlen 0; all -inf
    assert np.any(out[1] != 0) and np.any(out[3] != 0)


def test_a_softcap_that_rounds_to_zero_in_float32_is_off():
    """softcap is a float32 attribute: 1e-50 is 0 there, off (not a cap of 0, whose 0 * tanh(0 / 0) is NaN)."""
    q = np.array([[[1, 0, 0, 0]], [[0, 0, 0, 0]]], np.float32)
    k = np.array([[[1, 2, 3, 4]], [[0, 1, 0, 1]]], np.float32)
    v = np.array([[[1, 1, 1, 1]], [[3, 3, 3, 3]]], np.float32)
    args = dict(seqstarts=np.array([0, 1, 2]), kvstarts=np.array([0, 2, 4]), decoding_batches=np.array(0),
                max_seqlen=np.array(1), max_kvlen=np.array(2), num_heads=1, head_dim=4)
    keys, values = np.concatenate([k, k]), np.concatenate([v, v])
    off = multi_head_attention(q, keys, values, **args)
    tiny = multi_head_attention(q, keys, values, softcap=1e-50, **args)
    assert not np.isnan(off).any()
    np.testing.assert_array_equal(tiny, off)


def test_decoding_sequences_are_never_causal():
    """A decoding sequence with seqlen > 1: every query sees every key (ppl), so its queries' outputs only
    differ through their own scores; as the last non-decoding sequence it is causal."""
    case = build_attention("decoding", [(3, 5)], decoding=1, t="float32")
    zero_q = dict(case.inputs, query=np.zeros_like(case.inputs["query"]))
    decoding = multi_head_attention(**zero_q, **case.attributes)
    assert np.allclose(decoding[0], decoding[2])  # equal scores, same keys: the mean of all 5 values
    causal = multi_head_attention(**dict(zero_q, decoding_batches=np.array(0)), **case.attributes)
    assert not np.allclose(causal[0], causal[2])
    np.testing.assert_allclose(causal[2], decoding[2], rtol=1e-6)  # the last query sees everything either way


@pytest.mark.parametrize("t", ["float32", "float16", "bfloat16"])
def test_against_torch_scaled_dot_product_attention(t):
    """Each sequence through torch's SDPA with an explicit boolean mask (end-aligned causal, window), GQA by
    repeat_interleave, ALiBi and the attn_mask as a float mask: within the spec's bound of the oracle."""
    torch = pytest.importorskip("torch")
    case = build_attention("torch", [(1, 9), (4, 4), (3, 11), (2, 6)], heads=4, kv_heads=2, decoding=1,
                           sliding_window=5, mask=3, is_alibi=1, t=t, head_dim=16)
    i, a = case.inputs, case.attributes
    exact, bound = oracle(case)
    out = np.zeros(i["query"].shape, np.float64)
    slopes = torch.tensor(alibi_slopes(4), dtype=torch.float64)
    as64 = {k: torch.tensor(np.asarray(i[k]).astype(np.float64)) for k in ("query", "key", "value", "attn_mask")}
    for b in range(4):
        r0, r1, c0, c1 = (int(x) for x in (i["seqstarts"][b], i["seqstarts"][b + 1], i["kvstarts"][b], i["kvstarts"][b + 1]))
        s, k = r1 - r0, c1 - c0
        q = as64["query"][r0:r1].transpose(0, 1)
        keys = as64["key"][c0:c1].repeat_interleave(2, dim=1).transpose(0, 1)
        values = as64["value"][c0:c1].repeat_interleave(2, dim=1).transpose(0, 1)
        pos = torch.arange(s)[:, None] + (k - s)
        j = torch.arange(k)[None, :]
        allowed = (j > pos - a["sliding_window"]) & ((j <= pos) if (s > 1 and b >= 1) else True)
        bias = as64["attn_mask"][:, r0:r1, c0:c1] + slopes[:, None, None] * (j - pos).to(torch.float64)
        bias = bias.masked_fill(~allowed, float("-inf"))
        scale = float(np.float32(1 / np.sqrt(16)))
        out[r0:r1] = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias,
                                                                      scale=scale).transpose(0, 1).numpy()
    assert_within(out, exact, bound, "torch sdpa (float64) vs oracle")
    assert_within(multi_head_attention(**i, **a), out, 2 * bound, "reference vs torch sdpa")


def test_errors_are_multi_head_attention_errors_and_value_errors():
    case = build_attention("err", [(2, 2)])
    with pytest.raises(MultiHeadAttentionError, match=r"kvstarts\[B=1\] = 2 must equal key.shape\[0\] = 3"):
        longer = {k: np.concatenate([case.inputs[k]] * 2)[:3] for k in ("key", "value")}
        multi_head_attention(**dict(case.inputs, **longer), **case.attributes)
    assert issubclass(MultiHeadAttentionError, ValueError)


def test_bfloat16_output_dtype():
    case = build_attention("bf16", [(2, 3)], t="bfloat16")
    assert multi_head_attention(**case.inputs, **case.attributes).dtype == BFLOAT16


def test_the_bound_still_catches_wrong_outputs_next_to_a_padding_key():
    """One key per sequence with a large finite negative mask (padding) gets no weight: it must not loosen
    the bound so far that an all-zeros output, or one that drops a real key, passes."""
    case = build_attention("padding", [(1, 6)] * 4, heads=2, head_dim=16, decoding=4, mask=2, t="float16")
    mask = case.inputs["attn_mask"]
    mask[:] = 0
    mask[:, 5::6] = -65504  # the last key of every sequence: padding
    exact, bound = oracle(case)
    assert_within(multi_head_attention(**case.inputs, **case.attributes), exact, bound, "reference")
    assert np.any(np.abs(0 - exact) > bound), "an all-zeros output would pass"
    dropped = build_attention("padding", [(1, 6)] * 4, heads=2, head_dim=16, decoding=4, mask=2, t="float16")
    dropped.inputs["attn_mask"][:] = mask
    dropped.inputs["value"][0::6] = 0  # the first (real, weighted) key of every sequence contributes nothing
    wrong = multi_head_attention(**dropped.inputs, **dropped.attributes)
    assert np.any(np.abs(wrong.astype(np.float64) - exact) > bound), "a kernel dropping a key would pass"


def test_outputs_past_the_largest_finite_value_saturate():
    """The spec's output rounding: a finite float32 result past T's largest finite value gives that value of its sign
    (65520 and 1e6 would round to inf in float16; 3.4e38 in bfloat16), infinities and NaN stay, float32 unchanged."""
    from kvcache_op.reference.dtypes import saturating_cast

    values = np.array([65519.0, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan, 1.5], np.float32)
    half = saturating_cast(values, np.float16)
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half[:4], np.float16([65504, 65504, 65504, -65504]))
    assert np.isposinf(half[4]) and np.isneginf(half[5]) and np.isnan(half[6]) and half[7] == 1.5
    wide = saturating_cast(np.array([3.4e38, -3.4e38, 1.0], np.float32), BFLOAT16).astype(np.float32)
    big = np.float32(float.fromhex("0x1.fep127"))  # bfloat16's largest finite value
    np.testing.assert_array_equal(wide, np.float32([big, -big, 1.0]))
    np.testing.assert_array_equal(saturating_cast(values, np.float32), values)


def test_the_default_score_scale_is_one_over_sqrt_head_dim_in_float64_rounded_once():
    """softmax_scale 0 means float32(1 / sqrt(head_dim)) with the division and the root in float64: for these
    head_dims that differs by one ulp from dividing in float32, and the outputs equal, bit for bit, those of the
    float64-rounded scale given explicitly."""
    from kvcache_op.reference.mha_validate import AttentionAttributes, score_scale

    rounded_once = {6: 0x3ED105EC, 7: 0x3EC1848F, 17: 0x3E785B42, 96: 0x3DD105EC}  # float32 bits of 1/sqrt(d)
    rng = np.random.default_rng(0)
    for head_dim, bits in rounded_once.items():
        want = np.uint32(bits).view(np.float32)
        assert score_scale(AttentionAttributes(num_heads=1, head_dim=head_dim)) == want
        in_float32 = np.float32(1) / np.float32(np.sqrt(np.float32(head_dim)))
        assert in_float32 != want
        q = rng.standard_normal((4, 2, head_dim)).astype(np.float32) * 4
        k = rng.standard_normal((16, 2, head_dim)).astype(np.float32) * 4
        v = rng.standard_normal((16, 2, head_dim)).astype(np.float32)
        args = dict(seqstarts=np.array([0, 4]), kvstarts=np.array([0, 16]), decoding_batches=np.array(0),
                    max_seqlen=np.array(4), max_kvlen=np.array(16), num_heads=2, head_dim=head_dim)
        default = multi_head_attention(q, k, v, **args)
        np.testing.assert_array_equal(default, multi_head_attention(q, k, v, softmax_scale=float(want), **args))
        assert np.any(default != multi_head_attention(q, k, v, softmax_scale=float(in_float32), **args))
