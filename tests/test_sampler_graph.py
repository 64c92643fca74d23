"""The sampling graph against the host's sampler: the same distributions (float64, to rounding) for batches mixing
temperature, top-k, top-p and min-p over spread, tied, clipped and NaN rows, and the same tokens from the same
uniforms; greedy rows take their ArgMax; float16 and bfloat16 logits choose as their float32 values."""

import numpy as np
import pytest
from onnx import TensorProto

from sampler_graph_checks import check_against_host, run_graph
from sampling_batches import host_tokens, mixed_batch
from kvcache_op.reference.dtypes import BFLOAT16
from kvcache_op.serving import SamplingParams
from kvcache_op.serving.sampler_graph import NUCLEUS_SORT, Draws, graph_samplable, sampler_feeds, sampler_model
from kvcache_op.serving.sampling import choose_tokens


@pytest.mark.parametrize("width", [7, 300, 5000])
def test_the_graph_draws_the_hosts_tokens_from_the_hosts_distributions(width):
    """The least sort the rows need: the widest nuclei (temperature 4, top_p 0.999 over 5,000) pass it."""
    incomplete = check_against_host(np.random.default_rng(width + 1), width)
    assert (incomplete > 0) == (width > NUCLEUS_SORT)


@pytest.mark.parametrize("sort_width", [1, 3, 40])
def test_a_narrow_sort_gives_the_hosts_tokens_or_says_it_cannot(sort_width):
    """Sorting fewer tokens than nuclei hold: rows whose nucleus (or k-th token) lies past them are incomplete,
    the others still the host's."""
    assert check_against_host(np.random.default_rng(sort_width), 300, sort_width=sort_width) > 0


def test_sorting_whole_rows_gives_the_least_sorts_tokens():
    rng = np.random.default_rng(2)
    for _ in range(20):
        logits, params = mixed_batch(rng, 2000)
        uniforms = rng.random(len(params))
        tokens, distribution, complete = run_graph(logits, params, uniforms)
        whole = run_graph(logits, params, uniforms, sort_width=2000)
        assert whole[2][complete].all()  # all of these, and the rows whose nucleus passed the least sort too
        assert np.array_equal(tokens[complete], whole[0][complete])
        assert np.array_equal(distribution[complete], whole[1][complete], equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_half_logits_draw_the_hosts_tokens(dtype):
    """Clipped rows become infinities in float16; the graph clips them as the host does."""
    check_against_host(np.random.default_rng(17), 300, rounds=20, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_half_logits_choose_as_their_float32_values(dtype):
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((6, 500)) * 4).astype(dtype)
    logits[1, 10:20] = logits[1].max()  # ties with the most likely: the first is greedy's, all are kept by top-k 3
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0.6, top_k=40, top_p=0.5),
              SamplingParams(temperature=2.0)]
    uniforms = rng.random(6)
    tokens, distribution, _ = run_graph(logits, params, uniforms)
    wide_tokens, wide_distribution, _ = run_graph(logits.astype(np.float32), params, uniforms)
    assert np.array_equal(tokens, wide_tokens) and np.array_equal(distribution, wide_distribution)
    assert tokens.tolist() == host_tokens(logits.astype(np.float32), params, uniforms)


def test_seeded_requests_draw_the_hosts_tokens_step_after_step():
    """Each step's uniform drawn from the request's own generator: the graph's tokens are the host sampler's."""
    rng = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=1), SamplingParams(temperature=1.1, top_k=20, seed=2),
              SamplingParams(temperature=0.7, min_p=0.1, seed=3)]
    host_generators = [np.random.default_rng(p.seed) for p in params]
    graph_generators = [np.random.default_rng(p.seed) for p in params]
    for _ in range(30):
        logits = (rng.standard_normal((3, 1000)) * 3).astype(np.float32)
        host, _ = choose_tokens(logits, params, [((), ())] * 3, host_generators)
        tokens, _, _ = run_graph(logits, params, [g.random() for g in graph_generators])
        assert tokens.tolist() == host


def test_rows_fed_as_greedy_take_their_argmax_and_draw_nothing():
    """A row whose token is not wanted (None) is fed as greedy: its uniform is not read."""
    logits = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 2.0]], np.float32)
    feeds = sampler_feeds([None, SamplingParams()], [0.5, 0.5], 3)
    assert not feeds["temperature"].any() and not feeds["uniform"].any()
    tokens, distribution, _ = run_graph(logits, [None, SamplingParams()], [0.5, 0.5])
    assert tokens.tolist() == [1, 0] and not distribution.any()


def test_only_requests_without_penalties_or_logprobs_are_the_graphs():
    assert graph_samplable(SamplingParams(temperature=0.8, top_p=0.9, top_k=4, min_p=0.1, seed=3))
    for fields in (dict(logprobs=2), dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
                   dict(frequency_penalty=-0.5)):
        assert not graph_samplable(SamplingParams(temperature=0.8, **fields))


def test_a_logits_type_the_graph_cannot_take_is_refused():
    with pytest.raises(ValueError, match="float, float16 or bfloat16 logits, got INT8"):
        sampler_model(TensorProto.INT8)


def test_exact_boundaries_are_the_hosts():
    """Masses that are exact in float64 (four tokens of 1/4): a nucleus stops at the token whose running mass equals
    top_p, and a uniform equal to a running sum draws the token after it (the first sum that exceeds it)."""
    logits = np.full((4, 8), -np.inf, np.float32)
    logits[:, 2:6] = 0.0  # tokens 2-5, each 1/4
    params = [SamplingParams(temperature=1.0, top_p=0.5)] + [SamplingParams(temperature=1.0)] * 3
    uniforms = [0.9, 0.0, 0.5, 0.75]
    tokens, distribution, _ = run_graph(logits, params, uniforms)
    assert np.array_equal(distribution[0], [0, 0, 0.5, 0.5, 0, 0, 0, 0])  # 1/4 + 1/4 reaches 0.5: two tokens
    assert np.array_equal(distribution[1], [0, 0, 0.25, 0.25, 0.25, 0.25, 0, 0])
    assert tokens.tolist() == [3, 2, 4, 5] == host_tokens(logits, params, uniforms)
    # a uniform of 1 (outside [0, 1)): every running sum is at most it, and both take the last token
    assert run_graph(logits, params, [1.0] * 4)[0].tolist() == [7] * 4 == host_tokens(logits, params, [1.0] * 4)


def test_draws_come_from_each_requests_generator_and_can_be_taken_back():
    """One uniform per sampled row from its own generator (none for greedy rows or rows not wanted); taking rows'
    draws back leaves their generators as before, the others' drawn."""
    params = [SamplingParams(temperature=0.8), SamplingParams(), None, SamplingParams(temperature=1.5, top_k=3)]
    generators = [np.random.default_rng(seed) for seed in range(4)]
    states = [g.bit_generator.state for g in generators]
    draws = Draws(params, generators)
    assert draws.uniforms == [np.random.default_rng(0).random(), 0.0, 0.0, np.random.default_rng(3).random()]
    assert [g.bit_generator.state == s for g, s in zip(generators, states)] == [False, True, True, False]
    draws.take_back([3, 1])
    assert [g.bit_generator.state == s for g, s in zip(generators, states)] == [False, True, True, True]
    draws.take_back()
    assert [g.bit_generator.state for g in generators] == states


def test_no_node_reads_the_sorts_token_order():
    """ONNX Runtime's CUDA TopK does not give tied values in index order (its radix selection orders them by thread),
    where the host's stable sort does: the graph reads only the sorted values, and finds a nucleus's ties in token
    order itself."""
    graph = sampler_model().graph
    (top_k,) = [node for node in graph.node if node.op_type == "TopK"]
    readers = [node.op_type for node in graph.node if top_k.output[1] in node.input]
    assert readers == [] and top_k.output[1] not in {o.name for o in graph.output}


def test_huge_temperatures_over_infinite_logits_are_the_hosts():
    """The logits are clipped to +-FINITE before the temperature, as the host does: over a temperature near FINITE
    an infinite logit is a small number, and the row's other tokens keep some mass."""
    logits = np.array([[-np.inf, 0.0, 0.0], [np.inf, 0.0, 0.0]], np.float32)
    params = [SamplingParams(temperature=1e308)] * 2
    for u in (0.01, 0.2, 0.5, 0.99):
        tokens, distribution, _ = run_graph(logits, params, [u, u])
        assert tokens.tolist() == host_tokens(logits, params, [u, u])
    assert distribution[0, 0] > 0.05 and distribution[1, 1] > 0.05


def test_a_nucleus_short_of_top_p_by_rounding_is_complete_where_no_token_could_join():
    """top_p just below 1: the running mass of every kept token may fall short of it by rounding. The row is
    incomplete only where a token past the sorted ones could join the nucleus: not when the sort holds the whole
    vocabulary, nor when every token past it has no mass."""
    rng = np.random.default_rng(8)
    top_p = float(np.nextafter(1.0, 0.0))
    spread = (rng.standard_normal((16, 300)) * 3).astype(np.float32)
    masked = np.full((16, 5000), -np.inf, np.float32)
    masked[:, :10] = rng.standard_normal((16, 10))  # ten tokens of mass, sorted among the first 1,024
    wide = (rng.standard_normal((16, 5000)) * 2).astype(np.float32)
    for logits, sort_width, top_k in ((spread, 300, 0), (masked, None, 0), (wide, None, 1100)):
        # the last: top-k's 1,100 sorted (the least sort those rows need), and no token past them kept
        params, uniforms = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)] * 16, rng.random(16)
        tokens, _, complete = run_graph(logits, params, uniforms, sort_width=sort_width)
        assert complete.all()
        assert tokens.tolist() == host_tokens(logits, params, uniforms)


def test_a_batch_of_no_rows_gives_no_tokens():
    tokens, distribution, complete = run_graph(np.zeros((0, 300), np.float32), [], [])
    assert tokens.shape == complete.shape == (0,) and distribution.shape == (0, 300)
