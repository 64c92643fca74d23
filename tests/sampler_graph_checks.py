"""The sampling graph held to the host's sampler, on any EP: :func:`run_graph` runs it, :func:`check_against_host`
compares its distributions and tokens with the host's over mixed batches."""

import dataclasses

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from sampling_batches import host_tokens, mixed_batch
from kvcache_op.ort_ops import make_session
from kvcache_op.reference.dtypes import BFLOAT16
from kvcache_op.serving.sampler_graph import (COMPLETE, DISTRIBUTION, LOGITS, SORT_WIDTH, TOKENS, host_drawn,
                                              sampler_feeds, sampler_model)
from kvcache_op.serving.sampling import distributions

ELEMENT = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
           BFLOAT16: TensorProto.BFLOAT16}
_SESSIONS = {}


def run_graph(logits: np.ndarray, params: list, uniforms, provider: str = "CPUExecutionProvider",
              sort_width: int = None) -> tuple:
    """(tokens, distribution, complete) of the sampling graph on ``provider`` (a device's with no node on the CPU),
    brought to the host; ``sort_width``: the tokens it sorts, where not the least the rows need."""
    element = ELEMENT[logits.dtype]
    key = element, provider
    if key not in _SESSIONS:
        _SESSIONS[key] = make_session(sampler_model(element, distribution=True), (provider,),
                                      disable_cpu_fallback=provider != "CPUExecutionProvider")
    session = _SESSIONS[key]
    binding = session.io_binding()
    # numpy has no bfloat16 of its own: bound as its bits
    bits = logits.view(np.uint16) if logits.dtype == BFLOAT16 else np.ascontiguousarray(logits)
    binding.bind_ortvalue_input(LOGITS, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, element))
    feeds = sampler_feeds(params, uniforms, logits.shape[1])
    if sort_width is not None:
        feeds[SORT_WIDTH] = np.array([sort_width], np.int64)
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name in (TOKENS, DISTRIBUTION, COMPLETE):
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    return tuple(value.numpy() for value in binding.get_outputs())


def _kept(logits_row, p) -> np.ndarray:
    """The host's distribution of one row after min-p and top-k alone (no top-p)."""
    return distributions(logits_row[None], [dataclasses.replace(p, top_p=1.0)])[0]


def _at_a_rounding_boundary(logits_row, p, support: int, other_support: int) -> bool:
    """Whether two supports of ``support`` and ``other_support`` tokens differ only by rounding: the host's running
    mass of the smaller nucleus, most likely first, is within rounding of ``p.top_p`` (tied rows: 120 tokens of 1/120
    each reach 0.05 after six, give or take an ulp); or a token's probability is within rounding of min-p's threshold
    (``min_p`` times the most likely's: the two softmaxes differ in their last bits)."""
    kept = _kept(logits_row, p)
    mass = np.cumsum(np.sort(kept)[::-1])
    if p.top_p < 1.0 and abs(mass[min(support, other_support) - 1] - p.top_p) < 1e-12:
        return True
    q = distributions(logits_row[None], [dataclasses.replace(p, top_p=1.0, top_k=0, min_p=0.0)])[0]
    return p.min_p > 0 and bool(np.any(np.abs(q - p.min_p * q.max()) <= 1e-15 * q.max()))


def check_against_host(rng, width: int, rounds: int = 40, dtype=np.float32, provider: str = "CPUExecutionProvider",
                       sort_width: int = None) -> int:
    """``rounds`` mixed batches of ``width`` logits (of ``dtype``) through the graph on ``provider`` and the host's
    sampler. Float64 both, summed in other orders: equal distributions to rounding (the same tokens kept, but where a
    top-p nucleus's mass is within rounding of top_p, or a probability within rounding of min-p's threshold), and
    the same tokens from the same uniforms (but where the
    uniform falls within rounding of the boundary between two tokens' running sums); greedy rows take their ArgMax,
    sampled rows of NaN logits token 0. A row is incomplete only where its nucleus (or its top-k) is wider than the
    tokens sorted (``sort_width``, or the least the rows need) and more tokens of mass are kept than were sorted, and
    the host's draw for it (what the engine takes then) is the host sampler's token. Returns how many rows were
    incomplete."""
    near_a_boundary = compared = incomplete = 0
    for _ in range(rounds):
        logits, params = mixed_batch(rng, width)
        with np.errstate(over="ignore"):  # float16: the rows around +-1e38 become infinities
            logits = logits.astype(dtype)
        uniforms = rng.random(len(params))
        tokens, distribution, complete = run_graph(logits, params, uniforms, provider, sort_width)
        sorted_width = sampler_feeds(params, uniforms, width)[SORT_WIDTH][0] if sort_width is None else sort_width
        with np.errstate(invalid="ignore"):
            want = distributions(logits, params)
            host = host_tokens(logits, params, uniforms)
        assert not distribution[[r for r, p in enumerate(params) if p.greedy]].any()
        for r, p in enumerate(params):
            if np.isnan(logits[r].astype(np.float32)).any():
                if not p.greedy and complete[r]:  # no running sum is at most NaN (greedy: ArgMax passes over NaNs)
                    assert tokens[r] == host[r] == 0
                continue
            if p.greedy:
                assert complete[r] and tokens[r] == host[r] == np.argmax(logits[r].astype(np.float32))
                continue
            support, host_support = (distribution[r] > 0).sum(), (want[r] > 0).sum()
            if not complete[r]:  # only where the sort could not hold the nucleus, or the k-th token
                past_the_sort = (p.top_p < 1.0 and (_kept(logits[r], p) > 0).sum() > sorted_width
                                 and (host_support > sorted_width
                                      or _at_a_rounding_boundary(logits[r], p, sorted_width, sorted_width + 1)))
                assert past_the_sort or min(p.top_k, width) > sorted_width, (r, p, host_support, sorted_width)
                assert host_drawn(logits[[r]], sampler_feeds(params, uniforms, width), [r]).tolist() == [host[r]]
                incomplete += 1
                continue
            if support != host_support:
                assert _at_a_rounding_boundary(logits[r], p, support, host_support), (r, p)
                near_a_boundary += 1
                continue
            compared += 1
            assert np.array_equal(distribution[r] > 0, want[r] > 0)
            np.testing.assert_allclose(distribution[r], want[r], rtol=1e-12, atol=1e-300)
            if tokens[r] != host[r]:
                running = np.cumsum(want[r])
                boundary = running[min(tokens[r], host[r])]
                assert abs(uniforms[r] * running[-1] - boundary) < 1e-12, (r, tokens[r], host[r])
                near_a_boundary += 1
    assert compared >= rounds // 2 and near_a_boundary <= compared // 10
    return incomplete
