"""Helpers for running cases through the ORT CPU op and comparing with the reference."""

import numpy as np

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.reference import key_value_cache
from kvcache_op.validation.tolerance import bits_differ


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
        # Bit for bit, but any NaN matches any NaN: the spec leaves a NaN's payload bits open (the GPU's
        # conversions give 0x7e00 where numpy gives 0xfe00).
        differ = bits_differ(g, w)
        assert not differ.any(), f"{name} differs at {np.argwhere(differ)[0].tolist()}"


def model_for(inputs, symbolic_heads=False, **attrs):
    """spec.make_model with symbolic output dims (make_model's own would not fit a protobuf int64); with
    ``symbolic_heads`` current_key/value's H is symbolic too, so shape inference cannot see H * num_repeat."""
    model = spec.make_model(inputs, **{**attrs, "num_repeat": 1})
    for attr in model.graph.node[0].attribute:
        if attr.name == "num_repeat":
            attr.i = attrs.get("num_repeat", 1)
    for output in model.graph.output:
        for dim, name in zip(output.type.tensor_type.shape.dim, ("kv_tokens", "kv_heads", "head_dim")):
            dim.dim_param = name
    if symbolic_heads:
        for graph_input in model.graph.input[:2]:
            graph_input.type.tensor_type.shape.dim[1].dim_param = "heads"
    return model
