"""The slot vectors of the CUDA benchmark's torch baseline against the reference's own slot logic (the
plan its validation returns), for the benchmark's calls and for ragged batches in both cache modes."""

import numpy as np
import pytest

from kvcache_op.reference.validate import Attributes, validate_call
from kvcache_op.validation.cases import Seq, build
from kvcache_op.benchmarks import kv_shapes as bench_kvcache
from kvcache_op.validation.call_slots import call_slots


def _reference_slots(inputs, attributes):
    plan = validate_call(inputs["current_key"], inputs["current_value"], inputs["seqstarts"], inputs["kvstarts"],
                         inputs["cachestarts"], inputs["start_pos"], inputs["max_seqlen"], inputs["max_kvlen"],
                         inputs["cache"], inputs["scale"], Attributes(**attributes))
    flat = [np.concatenate([np.asarray(s, np.int64) for s in slots] + [np.zeros(0, np.int64)])
            for slots in (plan.store_slots, plan.load_slots)]
    return flat[0], flat[1]


def _our_slots(inputs, attributes):
    return call_slots(inputs["seqstarts"], inputs["kvstarts"], inputs["cachestarts"], inputs["start_pos"],
                      cache_mode=attributes.get("cache_mode", 0), page_size=attributes.get("page_size", 128))


@pytest.mark.parametrize("shape", bench_kvcache.QUICK_SHAPES, ids=lambda s: s.name)
def test_slots_of_the_benchmark_calls_match_the_reference(shape):
    inputs = bench_kvcache.make_inputs(shape, 0, 0)
    attributes = dict(cache_mode=1, page_size=shape.page_size)
    store, load = _our_slots(inputs, attributes)
    want_store, want_load = _reference_slots(inputs, attributes)
    assert np.array_equal(store, want_store) and np.array_equal(load, want_load)
    assert len(np.unique(load)) == load.size  # shuffled pages, still one slot per gathered token


@pytest.mark.parametrize("mode", [0, 1])
def test_slots_of_ragged_batches_match_the_reference(mode):
    seqs = [Seq(5, 3), Seq(0, 0), Seq(0, 7), Seq(9, 1, kvlen=4), Seq(2, 0, kvlen=2), Seq(30, 6)]
    case = build("slots", seqs, cache_mode=mode, page_size=4, seed=3)
    store, load = _our_slots(case.inputs, case.attributes)
    want_store, want_load = _reference_slots(case.inputs, case.attributes)
    assert store.size == int(case.inputs["seqstarts"][-1]) and load.size == int(case.inputs["kvstarts"][-1])
    assert np.array_equal(store, want_store) and np.array_equal(load, want_load)


def test_slots_of_an_empty_batch():
    store, load = call_slots([0], [0], np.zeros((0, 2), np.int64), np.zeros(0, np.int64), cache_mode=1,
                             page_size=4)
    assert store.shape == load.shape == (0,)
