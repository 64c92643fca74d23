"""The write-order rule: ONNX orders nodes only by data, so a runtime may run two nodes that share no data
path in either order (ONNX Runtime does reorder them). For in-place writes that would make the result
depend on the runtime's choice, so a model is refused when

* two nodes write the same layer of one cache (KeyValueCache's and MultiHeadCacheAttention's stores,
  KeyCacheRotaryShift's rotation)
  and neither depends on the other through data, or
* any other node reads an in-place input's data (it may see the cache before or after the writes).

Nodes writing different layers of one cache (the usual one node per layer) are independent and allowed;
``Shape`` and ``Size`` read no data and are allowed.
"""

import itertools

#: Ops that read a tensor's shape or size only, never its data.
METADATA_READERS = {("", "Shape"), ("", "Size")}


def _layer(node) -> int:
    return next((a.i for a in node.attribute if a.name == "layer_idx"), 0)


def _describe(node) -> str:
    return f"{node.op_type} node {node.name or '(unnamed)'} (layer_idx {_layer(node)})"


def _reaches(graph, start: int, goal: int, consumers) -> bool:
    """Whether node ``goal`` depends on node ``start`` through data."""
    seen, todo = {start}, [start]
    while todo:
        for output in graph.node[todo.pop()].output:
            for nxt in consumers.get(output, ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return False


def check_write_order(graph, writers: dict) -> None:
    """``writers``: in-place input name -> indices (in ``graph.node``) of the nodes writing it. Raises
    ``ValueError`` naming the nodes when the rule above is broken."""
    for index, node in enumerate(graph.node):
        if (node.domain, node.op_type) in METADATA_READERS:
            continue
        for name in set(node.input) & set(writers):
            if index not in writers[name]:
                raise ValueError(
                    f"{node.op_type} node {node.name or '(unnamed)'} reads {name!r}, which "
                    f"{_describe(graph.node[writers[name][0]])} writes in place: ONNX orders nodes only by data, so "
                    "the read may see the cache before or after the write. Read the op's outputs instead, or run "
                    "the read in another model")
    consumers = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(index)
    for name, indices in writers.items():
        for first, second in itertools.combinations(sorted(set(indices)), 2):
            a, b = graph.node[first], graph.node[second]
            if _layer(a) != _layer(b):
                continue
            if not (_reaches(graph, first, second, consumers) or _reaches(graph, second, first, consumers)):
                raise ValueError(
                    f"{_describe(a)} and {_describe(b)} both write layer {_layer(a)} of {name!r} and no data path "
                    "orders them: ONNX Runtime may run them in either order. Put them in separate models (or "
                    "runs), or write different layers")
