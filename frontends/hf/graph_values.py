"""Small helpers the exporter's graph rewrites share."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def new_initializer(graph, name: str, array: np.ndarray) -> ir.Value:
    """A new initializer of ``graph`` holding ``array``, named ``name`` (with a suffix when a value of the graph
    already has that name: rewrites may run twice, and nodes may be unnamed)."""
    taken = {v.name for v in graph.initializers.values()} | {v.name for n in graph for v in n.outputs} | \
        {v.name for v in graph.inputs}
    unique, i = name, 0
    while unique in taken:
        i += 1
        unique = f"{name}_{i}"
    value = ir.Value(name=unique, const_value=ir.tensor(array))
    graph.register_initializer(value)
    return value
