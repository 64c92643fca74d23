"""The write-order rule: ONNX orders nodes only by data, so a runtime may run two nodes that share no data
path in either order (ONNX Runtime does reorder them). For in-place writes that would make the result
depend on the runtime's choice, so a model is refused when

* two nodes write the same layer of one cache (KeyValueCache's and MultiHeadCacheAttention's stores,
  KeyCacheRotaryShift's rotation)
  and neither depends on the other through data, or
* any other node reads an in-place input's data (it may see the cache before or after the writes).

Nodes writing different layers of one cache (the usual one node per layer) are independent and allowed;
``Shape`` and ``Size`` read no data and are allowed.

A control-flow node (``If``, ``Loop``, ``Scan``) writes what the nodes of its bodies write and reads what they read:
a body reads the values of the graph around it by name, and ONNX Runtime hands it the caller's buffers, so a store
inside an ``If`` branch lands in the caller's cache like one outside. Each body is held to the same rule among its
own nodes.
"""

import itertools

import onnx

#: Ops that read a tensor's shape or size only, never its data.
METADATA_READERS = {("", "Shape"), ("", "Size")}


def _layer(node) -> int:
    return next((a.i for a in node.attribute if a.name == "layer_idx"), 0)


def _bodies(node):
    """The subgraphs of ``node`` (an If's branches, a Loop's or Scan's body)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        yield from attribute.graphs


def _effects(node, writes_of) -> tuple:
    """(in-place input name -> layers written, names whose data is read, names used) by ``node`` and the nodes of
    its bodies. A node's read of what it writes itself is its write; the names used order it after their producers
    (a body's use of an outer value is an input of the node holding the body)."""
    own = set(writes_of(node))
    writes = {name: {_layer(node)} for name in own}
    reads = set() if (node.domain, node.op_type) in METADATA_READERS else set(node.input) - own - {""}
    used = set(node.input)
    for body in _bodies(node):
        for inner in body.node:
            inner_writes, inner_reads, inner_used = _effects(inner, writes_of)
            for name, layers in inner_writes.items():
                writes.setdefault(name, set()).update(layers)
            reads |= inner_reads
            used |= inner_used
    return writes, reads, used


def _describe(node, layers) -> str:
    inside = " inside it" if any(True for _ in _bodies(node)) else ""
    return f"{node.op_type} node {node.name or '(unnamed)'} (layer_idx {', '.join(map(str, sorted(layers)))}{inside})"


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


def check_write_order(graph, writes_of) -> None:
    """``writes_of(node)``: the in-place input names ``node`` itself writes. Raises ``ValueError`` naming the nodes
    when the rule above is broken in ``graph`` or in any body of its nodes."""
    effects = [_effects(node, writes_of) for node in graph.node]
    writers = {}  # name -> indices (in graph.node) of the nodes writing it
    for index, (writes, _, _) in enumerate(effects):
        for name in writes:
            writers.setdefault(name, []).append(index)
    for index, (_, reads, _) in enumerate(effects):
        node = graph.node[index]
        for name in sorted(reads & set(writers)):
            other = next((i for i in writers[name] if i != index), None)
            if other is not None:
                where = "" if name in node.input else " inside it"
                raise ValueError(
                    f"{node.op_type} node {node.name or '(unnamed)'} reads {name!r}{where}, which "
                    f"{_describe(graph.node[other], effects[other][0][name])} writes in place: ONNX orders nodes only "
                    "by data, so the read may see the cache before or after the write. Read the op's outputs "
                    "instead, or run the read in another model")
    consumers = {}
    for index, (_, _, used) in enumerate(effects):
        for name in used:
            consumers.setdefault(name, []).append(index)
    for name, indices in writers.items():
        for first, second in itertools.combinations(indices, 2):
            common = effects[first][0][name] & effects[second][0][name]
            if common and not (_reaches(graph, first, second, consumers) or _reaches(graph, second, first, consumers)):
                a, b = graph.node[first], graph.node[second]
                raise ValueError(
                    f"{_describe(a, effects[first][0][name])} and {_describe(b, effects[second][0][name])} both write "
                    f"layer {min(common)} of {name!r} and no data path orders them: ONNX Runtime may run them in "
                    "either order. Put them in separate models (or runs), or write different layers")
    for node in graph.node:
        for body in _bodies(node):
            check_write_order(body, writes_of)
