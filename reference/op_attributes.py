"""A node's attributes as the reference ops' ``onnx.reference`` runners take them: checked as the package's ONNX Runtime
sessions check them (an attribute the op does not have is refused by ``make_session``, which checks each node against
the op's schema; one of the wrong type by the kernel itself), so a misspelled or mistyped attribute is an error here
too, never a silent default."""

import functools
import inspect

import numpy as np

from .validate import KeyValueCacheError


def _onnx_type(value) -> str:
    """The ONNX attribute type a value read from a node has (onnx.reference gives an INT as an int, a FLOAT as a
    numpy float32)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return "INT"
    if isinstance(value, (float, np.floating)):
        return "FLOAT"
    return type(value).__name__


@functools.lru_cache(maxsize=None)
def _keyword_parameters(function) -> dict:
    """{name: parameter} of ``function``'s keyword-only parameters (an op's attributes), read once per function."""
    return {p.name: p for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY}


def node_attributes(function, op_type: str, given: dict) -> dict:
    """The keyword arguments of ``function`` (the op's reference) that a node's attributes ``given`` set, absent
    ones (None) left out. ``KeyValueCacheError`` naming an attribute the op does not have, or one of another type
    than its default's (an INT attribute written as a FLOAT, or the other way round)."""
    params = _keyword_parameters(function)
    unknown = sorted(set(given) - set(params))
    if unknown:
        raise KeyValueCacheError(f"{op_type}: unknown attribute(s) {unknown}; its attributes are {sorted(params)}")
    attributes = {}
    for name, value in given.items():
        if value is None:
            continue
        want = "FLOAT" if isinstance(params[name].default, float) else "INT"  # num_heads/head_dim (no default): INT
        got = _onnx_type(value)
        if got != want:
            raise KeyValueCacheError(f"{op_type}: the attribute {name} must be of type {want}, the node gives it as "
                                     f"{got}")
        attributes[name] = float(value) if want == "FLOAT" else int(value)
    return attributes
