"""Token choice: greedy is argmax; seeded draws follow the model's own softmax (a chi-square test on a small
vocabulary), top-k / top-p / min-p keep exactly their subsets, penalties move the logits as vLLM's do, a seeded
request draws the same tokens whatever runs beside it, and bad parameters are refused by name."""

import dataclasses
import math

import numpy as np
import pytest

from sampling_batches import counted_draws, mixed_batch
from kvcache_op.serving import SamplingParams
from kvcache_op.serving.sampling import FINITE, choose_tokens, distributions, greedy_tokens, top_in_order

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0], np.float32)


def _draws(params: SamplingParams, n: int, seed=0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    counts = np.zeros(len(LOGITS), np.int64)
    for _ in range(n):
        (token,), _ = choose_tokens(LOGITS[None], [params], [((), ())], [generator])
        counts[token] += 1
    return counts


def _softmax(z):
    z = np.exp(z - z.max())
    return z / z.sum()


def _chi_square_p(counts, probs) -> float:
    """The upper tail of Pearson's statistic (the regularized gamma function, series form; no scipy needed)."""
    keep = probs > 0
    expected = counts.sum() * probs[keep]
    statistic = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    a, x = dof / 2, statistic / 2
    term = total = 1 / a
    for k in range(1, 500):
        term *= x / (a + k)
        total += term
    lower = total * math.exp(-x + a * math.log(x) - math.lgamma(a)) if x > 0 else 0.0
    return 1 - lower


def test_greedy_is_argmax_and_needs_no_generator():
    tokens, logprobs = choose_tokens(np.stack([LOGITS, LOGITS[::-1]]), [SamplingParams()] * 2, [((), ())] * 2, [None] * 2)
    assert tokens == [0, 7] and logprobs == [None, None]


def test_greedy_tokens_of_float16_logits_are_numpys_argmax_of_them_for_every_value():
    """Widening float16 logits to float32 (the fast path) keeps numpy's own answer: every float16 bit pattern (NaNs,
    infinities, both zeros, subnormals) in rows of its own order, rows of equal maxima, of +0 and -0 side by side,
    and of NaN after the maximum."""
    rng = np.random.default_rng(3)
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rows = [rng.permutation(every)[:4096] for _ in range(48)]
    rows += [rng.choice(every[np.isfinite(every)], 4096) for _ in range(16)]  # no NaN: the maximum decides
    rows += [rng.integers(-3, 3, 4096).astype(np.float16) for _ in range(8)]  # many equal maxima
    zeros = np.full(4096, -1.0, np.float16)
    zeros[[7, 9]] = [-0.0, 0.0]  # equal: the first
    late_nan = np.zeros(4096, np.float16)
    late_nan[[5, 4000]] = [1.0, np.nan]
    logits = np.stack(rows + [zeros, late_nan])
    with np.errstate(invalid="ignore"):
        expected = np.argmax(logits, axis=1)
    assert np.array_equal(greedy_tokens(logits), expected)
    assert expected[-2] == 7 and expected[-1] == 4000
    for dtype in (np.float32, np.float64):  # other types as they are
        wide = logits.astype(dtype)
        assert np.array_equal(greedy_tokens(wide), np.argmax(wide, axis=1))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_draws_follow_the_softmax_of_the_logits_over_the_temperature(temperature):
    counts = _draws(SamplingParams(temperature=temperature, seed=1), 20000)
    p = _chi_square_p(counts, _softmax(LOGITS.astype(np.float64) / temperature))
    assert p > 1e-3, (counts, p)


@pytest.mark.parametrize("params, support", [
    (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
    (SamplingParams(temperature=1.0, top_p=0.7), {0, 1}),       # softmax 0.531, 0.195, 0.118 ...: two reach 0.7
    (SamplingParams(temperature=1.0, top_p=0.5), {0}),          # the top one alone reaches 0.5
    (SamplingParams(temperature=1.0, top_p=0.0), {0}),          # OpenAI's 0: the most likely token alone
    (SamplingParams(temperature=1.0, min_p=0.2), {0, 1, 2}),    # >= 0.2 x 0.531
    # top_p over what top_k left, renormalized (0.731, 0.269): the top one alone reaches 0.7, as in vLLM
    (SamplingParams(temperature=1.0, top_k=2, top_p=0.7), {0}),
])
def test_top_k_top_p_and_min_p_keep_their_subset_renormalized(params, support):
    probs = distributions(LOGITS[None].astype(np.float64), [params])[0]
    assert set(np.flatnonzero(probs)) == support and math.isclose(probs.sum(), 1.0)
    want = _softmax(LOGITS.astype(np.float64))
    for token in support:  # the kept tokens keep their relative weights
        assert math.isclose(probs[token] / probs[0], want[token] / want[0], rel_tol=1e-12)
    counts = _draws(dataclasses.replace(params, seed=3), 6000)
    assert set(np.flatnonzero(counts)) <= support
    if len(support) > 1:
        assert _chi_square_p(counts, probs) > 1e-3


def test_a_seed_gives_the_same_draws_whatever_runs_beside_it():
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [choose_tokens(LOGITS[None], [seeded], [((), ())], [g])[0][0]
             for g in [np.random.default_rng(42)] for _ in range(50)]
    g, other = np.random.default_rng(42), np.random.default_rng(7)
    beside = []
    for _ in range(50):
        tokens, _ = choose_tokens(np.stack([LOGITS[::-1], LOGITS]), [SamplingParams(temperature=2.0), seeded],
                                  [((), ()), ((), ())], [other, g])
        beside.append(tokens[1])
    assert beside == alone and len(set(alone)) > 1


def test_penalties_move_the_logits_as_vllm_does():
    """Repetition divides positive logits and multiplies negative ones of tokens in the prompt or the output;
    presence and frequency subtract from the output's tokens only."""
    logits = np.array([[1.0, 0.9, -0.1, -0.2]], np.float32)
    assert choose_tokens(logits, [SamplingParams()], [((), ())], [None])[0] == [0]
    assert choose_tokens(logits, [SamplingParams(repetition_penalty=2.0)], [((0,), ())], [None])[0] == [1]
    assert choose_tokens(logits, [SamplingParams(frequency_penalty=0.2)], [((), (0, 0))], [None])[0] == [1]
    assert choose_tokens(logits, [SamplingParams(presence_penalty=2.0)], [((), (0, 1))], [None])[0] == [2]
    assert choose_tokens(logits, [SamplingParams(presence_penalty=2.0)], [((0, 1), ())], [None])[0] == [0]


def test_logprobs_are_the_top_n_of_the_chosen_distribution():
    (token,), (entry,) = choose_tokens(LOGITS[None], [SamplingParams(logprobs=2)], [((), ())], [None])
    want = np.log(_softmax(LOGITS.astype(np.float64)))
    assert token == 0 and [t for t, _ in entry.top] == [0, 1]
    assert all(math.isclose(lp, want[t], rel_tol=1e-9) for t, lp in entry.top)
    assert math.isclose(entry.logprob, want[0], rel_tol=1e-9)


def test_logprobs_are_the_models_whatever_the_temperature_filters_and_penalties():
    """Logprobs are the model's own distribution (vLLM's raw logprobs; OpenAI's do not move with the temperature):
    a tempered, filtered, penalized request reports the logits' log-softmax, its filtered-out tokens included
    (they read -inf, reported as -9999, when logprobs were the sampling distribution's)."""
    want = np.log(_softmax(LOGITS.astype(np.float64)))
    n = LOGITS.size
    for fields in (dict(temperature=0.3), dict(temperature=2.0, top_k=1), dict(temperature=0.7, top_p=0.2),
                   dict(temperature=0.0, repetition_penalty=3.0, presence_penalty=1.5), dict(min_p=0.9, temperature=1)):
        params = SamplingParams(logprobs=n, seed=0, **fields)
        (token,), (entry,) = choose_tokens(LOGITS[None], [params], [((0, 1), (0,))], [np.random.default_rng(0)])
        assert [t for t, _ in entry.top] == list(np.argsort(-want, kind="stable")), fields
        assert all(math.isclose(lp, want[t], rel_tol=1e-9) for t, lp in entry.top), fields
        assert math.isclose(entry.logprob, want[token], rel_tol=1e-9), fields


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    params = [SamplingParams(temperature=0.7, top_k=k) for k in (0, LOGITS.size, 2 ** 70)]
    probs = distributions(np.stack([LOGITS] * 3), params)
    assert np.array_equal(probs[1], probs[0]) and np.array_equal(probs[2], probs[0])


def test_a_sampled_token_outside_the_top_n_keeps_its_own_logprob():
    logits = np.array([[3.0, 2.0, 1.0, 0.5]], np.float32)
    params = SamplingParams(temperature=1.0, logprobs=1, seed=0)
    want = np.log(_softmax(logits[0].astype(np.float64)))
    seen = set()
    rng = np.random.default_rng(1)
    for _ in range(200):
        (token,), (entry,) = choose_tokens(logits, [params], [((), ())], [rng])
        seen.add(token)
        assert entry.top == [(0, pytest.approx(want[0]))]
        assert math.isclose(entry.logprob, want[token], rel_tol=1e-9)
    assert seen - {0}  # some draws fell outside the top 1


@pytest.mark.parametrize("fields, error, message", [
    (dict(temperature=-0.1), ValueError, r"temperature must be in \[0.0, inf\]"),
    (dict(temperature=math.nan), TypeError, "temperature must be a finite number"),
    (dict(top_p=-0.1), ValueError, r"top_p must be in \[0.0, 1.0\]"),
    (dict(top_k=-1), ValueError, "top_k must be >= 0"),
    (dict(top_k=2.0), TypeError, "top_k must be an integer"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0.0, 1.0\]"),
    (dict(seed=-3), ValueError, "seed must be >= 0"),
    (dict(seed=True), TypeError, "seed must be an integer"),
    (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (dict(stop_token_ids="2"), TypeError, "stop_token_ids must be a list of token ids"),
    (dict(stop=[""]), TypeError, "stop must be a string or a list of non-empty strings"),
    (dict(stop=None), TypeError, "stop must be a string or a list of non-empty strings, got NoneType None"),
    (dict(stop=5), TypeError, "stop must be a string or a list of non-empty strings, got int 5"),
    (dict(stop={"x": 1}), TypeError, "stop must be a string or a list of non-empty strings, got dict"),
    (dict(presence_penalty=3.0), ValueError, r"presence_penalty must be in \[-2.0, 2.0\]"),
    (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be in \(0.0, inf\]"),
    (dict(logprobs=-1), ValueError, "logprobs must be >= 0"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be a bool"),
])
def test_bad_parameters_are_refused_by_name(fields, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


def _row_by_row(logits, params):
    """The filters one row at a time, written apart from the batch code after vLLM's steps: softmax / temperature;
    min_p masks the logits of tokens below min_p times the row's largest probability; top_k masks every logit
    below the k-th largest of what is left; top_p sorts what is left ascending, takes its softmax again and masks
    the tokens whose cumulative mass is at most 1 - top_p, the most likely always kept."""
    out = np.zeros(logits.shape)
    for r, p in enumerate(params):
        if p.greedy:
            continue
        z = [float(v) / p.temperature for v in logits[r]]
        q = _softmax(np.array(z))
        if p.min_p:
            z = [v if q[t] >= p.min_p * q.max() else -math.inf for t, v in enumerate(z)]
        if p.top_k:
            kth = sorted(z, reverse=True)[min(p.top_k, len(z)) - 1]
            z = [v if v >= kth else -math.inf for v in z]
        if p.top_p < 1.0:
            ascending = sorted(range(len(z)), key=lambda t: z[t])
            mass = np.cumsum(_softmax(np.array([z[t] for t in ascending])))
            for i, t in enumerate(ascending[:-1]):
                if mass[i] <= 1 - p.top_p:
                    z[t] = -math.inf
        out[r] = _softmax(np.array(z))
    return out


def test_the_batch_filters_equal_the_row_by_row_ones_for_mixed_requests():
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((9, 40)) * 3
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, min_p=0.1),
              SamplingParams(temperature=2.0, top_k=12, top_p=0.6, min_p=0.02), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.9, top_p=0.05)]
    got, want = distributions(logits, params), _row_by_row(logits, params)
    assert np.allclose(got, want, rtol=1e-12, atol=1e-15)
    assert np.array_equal(got > 0, want > 0)  # the same support, exactly


def test_top_k_keeps_every_token_tied_with_the_kth():
    """vLLM masks the logits below the k-th largest: a token equal to it stays, whatever its index."""
    logits = np.array([[2.0, 1.0, 1.0, 0.0]])
    probs = distributions(logits, [SamplingParams(temperature=1.0, top_k=2)])[0]
    want = _softmax(np.array([2.0, 1.0, 1.0, -np.inf]))
    assert np.allclose(probs, want, rtol=1e-12, atol=0) and probs[3] == 0


def test_presence_penalty_is_subtracted_once_however_often_a_token_came():
    """Presence is per token seen, frequency per occurrence: three 1s cost token 1 one presence penalty but
    three frequency penalties."""
    logits = np.array([[1.0, 2.5, 0.0]], np.float32)
    thrice = [((), (1, 1, 1))]
    assert choose_tokens(logits, [SamplingParams(presence_penalty=1.0)], thrice, [None])[0] == [1]  # 2.5 - 1
    assert choose_tokens(logits, [SamplingParams(frequency_penalty=0.6)], thrice, [None])[0] == [0]  # 2.5 - 1.8


def test_a_token_that_alone_reaches_top_p_exactly_is_the_whole_support():
    """top_p keeps the smallest prefix whose mass reaches top_p: 0.5 reaches 0.5, so nothing after it is kept."""
    logits = np.log(np.array([[0.5, 0.25, 0.25]]))
    probs = distributions(logits, [SamplingParams(temperature=1.0, top_p=0.5)])[0]
    np.testing.assert_allclose(probs, [1.0, 0.0, 0.0], rtol=0, atol=1e-12)


def test_min_p_keeps_a_token_exactly_min_p_times_as_likely_as_the_top_one():
    """min_p keeps every token at least min_p times the largest probability: 0.25 is 0.5 x 0.5, kept."""
    logits = np.log(np.array([[0.5, 0.25, 0.25]]))
    probs = distributions(logits, [SamplingParams(temperature=1.0, min_p=0.5)])[0]
    np.testing.assert_allclose(probs, [0.5, 0.25, 0.25], rtol=1e-12, atol=0)


def _every_row_sorted(logits, params):
    """The filters as the batch code first computed them: every row's softmax, min-p mask, full descending sort for
    the k-th largest and full stable argsort and running sum for top-p, whatever the row asks for."""
    probs = np.zeros_like(logits, dtype=np.float64)
    rows = np.array([r for r, p in enumerate(params) if not p.greedy], np.int64)
    if not rows.size:
        return probs
    chosen = [params[r] for r in rows]
    temperature = np.array([p.temperature for p in chosen])[:, None]
    top_k = np.array([min(p.top_k, logits.shape[1]) for p in chosen], np.int64)[:, None]
    top_p = np.array([p.top_p for p in chosen])[:, None]
    min_p = np.array([p.min_p for p in chosen])[:, None]
    with np.errstate(over="ignore"):
        z = np.clip(np.asarray(logits, np.float64)[rows] / temperature, -FINITE, FINITE)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    q = z / z.sum(axis=1, keepdims=True)
    keep = (min_p == 0) | (q >= min_p * q.max(axis=1, keepdims=True))
    descending = -np.sort(-q, axis=1)
    kth = np.take_along_axis(descending, np.maximum(top_k - 1, 0), axis=1)
    keep &= (top_k == 0) | (q >= kth)
    kept = np.where(keep, q, 0.0)
    kept /= kept.sum(axis=1, keepdims=True)
    order = np.argsort(-kept, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(q.shape[1])[None, :], axis=1)
    mass = np.cumsum(np.take_along_axis(kept, order, axis=1), axis=1)
    cut = (mass < top_p).sum(axis=1, keepdims=True) + 1
    keep &= (top_p >= 1.0) | (rank < cut)
    q = np.where(keep, q, 0.0)
    probs[rows] = q / q.sum(axis=1, keepdims=True)
    return probs


@pytest.mark.parametrize("width", [7, 300, 5000])
def test_the_filters_and_draws_equal_every_row_sorted_bit_for_bit(width):
    """Sorting only a row's most likely tokens, and only for the rows that ask, gives the distributions of sorting
    every row whole, bit for bit (top-p's nucleus past its first candidates included: high temperatures, top_p
    0.999), so the seeded draws are the same tokens."""
    rng = np.random.default_rng(width)
    for _ in range(40):
        logits, params = mixed_batch(rng, width)
        with np.errstate(invalid="ignore"):
            want = _every_row_sorted(logits, params)
            assert np.array_equal(distributions(logits, params), want, equal_nan=True)
            histories, seeds = [((), ())] * len(params), rng.integers(0, 2**31, len(params))
            tokens, _ = choose_tokens(logits, params, histories, [np.random.default_rng(int(x)) for x in seeds])
            sampled = [r for r, p in enumerate(params) if not p.greedy]
            expected = np.argmax(logits.astype(np.float64), axis=1)
            if sampled:
                expected[sampled] = counted_draws(want[sampled],
                                                   [np.random.default_rng(int(seeds[r])) for r in sampled])
        assert tokens == expected.tolist()


def test_the_most_likely_tokens_come_in_the_order_of_a_stable_sort():
    """``top_in_order`` against the whole stable argsort: ties with the n-th (kept by index), NaN last, n past the
    row, n of 0."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        values = rng.integers(-3, 4, int(rng.integers(1, 60))).astype(np.float64)
        values[rng.random(len(values)) < 0.1] = np.nan
        values[rng.random(len(values)) < 0.1] = -0.0
        n = int(rng.integers(0, len(values) + 3))
        assert np.array_equal(top_in_order(values, n), np.argsort(-values, kind="stable")[:n]), (values, n)


def test_infinite_logits_are_sampled_without_a_warning():
    """A model that masks tokens with -inf (and one giving +inf): the tokens of +inf share the draw, and numpy says
    nothing of the -inf reached on the way."""
    logits = np.array([[np.inf, 0.0, -np.inf, np.inf], [-np.inf, 2.0, 1.0, -np.inf]], np.float32)
    params = [SamplingParams(temperature=1.5), SamplingParams(temperature=0.5, top_p=0.8)]
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # numpy's defaults warn of these, not underflow
        probs = distributions(logits, params)
        choose_tokens(logits, params, [((), ())] * 2, [np.random.default_rng(0)] * 2)
    assert np.array_equal(probs, [[0.5, 0, 0, 0.5], [0, 1, 0, 0]])  # token 1 alone: its 0.88 reaches 0.8
