"""Helpers for running cases through the ORT CPU op and comparing with the reference."""

import numpy as np

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import key_value_cache


def copies(inputs):
    return {k: (None if v is None else np.array(v, copy=True)) for k, v in inputs.items()}


def reference_result(inputs, attrs):
    """(key, value, cache, scale) of the reference on copies of ``inputs``."""
    fresh = copies(inputs)
    key, value = key_value_cache(**fresh, **attrs)
    return key, value, fresh["cache"], fresh["scale"]


def ort_result(inputs, attrs, intra_op_num_threads=1):
    """(key, value, cache, scale) of the ORT CPU op on copies of ``inputs``."""
    fresh = copies(inputs)
    model = spec.make_model(fresh, **attrs)
    session = make_session(model, intra_op_num_threads=intra_op_num_threads)
    feeds = {k: v for k, v in fresh.items() if v is not None}
    key, value = run_model(model, feeds, session=session)
    return key, value, fresh["cache"], fresh["scale"]


def assert_same_bits(got, want, names=("key", "value", "cache", "scale")):
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None, name
            continue
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        assert g.tobytes() == w.tobytes(), f"{name} differs"
