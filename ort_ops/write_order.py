"""The write-order rule: ONNX orders nodes only by data, so a runtime may run two nodes that share no data
path in either order (ONNX Runtime does reorder them). For in-place writes that would make the result
depend on the runtime's choice, so a model is refused when

* two nodes write the same layer of one cache (KeyValueCache's and MultiHeadCacheAttention's stores,
  KeyCacheRotaryShift's rotation)
  and neither depends on the other through data, or
* any other node reads an in-place input's data (it may see the cache before or after the writes), or
* two nodes write one cache in different layouts (``cache_layout``): the layers of one overlap the other's.

Nodes writing different layers of one cache (the usual one node per layer) are independent and allowed;
``Shape`` and ``Size`` read no data and are allowed.

A control-flow node (``If``, ``Loop``, ``Scan``) writes what the nodes of its bodies write and reads what they
read: a body reads the values of the graph around it by name, and ONNX Runtime hands it the caller's buffers, so a
store inside an ``If`` branch lands in the caller's cache like one outside. A name a body defines itself (its inputs,
initializers and node outputs) is the body's own value, whatever is called so outside. A control-flow node may not
also pass a cache its bodies write as an explicit input (a ``Loop``'s carried value, a ``Scan``'s scanned input): the
body gets the same buffer under another name, and its reads of it are unordered against the writes. Each body is
held to the same rules among its own nodes.
"""

import itertools

import onnx

#: Ops that read a tensor's shape or size only, never its data ("ai.onnx" is the default domain's other name).
METADATA_READERS = {(domain, op) for domain in ("", "ai.onnx") for op in ("Shape", "Size")}


def _attribute(node, name: str) -> int:
    return next((a.i for a in node.attribute if a.name == name), 0)  # layer_idx and cache_layout default to 0


def subgraphs(node):
    """The subgraphs of ``node`` (an If's branches, a Loop's or Scan's body)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        yield from attribute.graphs


def _has_bodies(node) -> bool:
    return any(True for _ in subgraphs(node))


def defined(graph) -> set:
    """The names ``graph`` defines itself: its inputs, initializers and node outputs (inside a body, these hide the
    values of the same name around it)."""
    names = {value.name for value in graph.input} | {tensor.name for tensor in graph.initializer}
    names |= {sparse.values.name for sparse in graph.sparse_initializer}
    return (names | {output for node in graph.node for output in node.output}) - {""}


def _effects(node, writes_of) -> tuple:
    """What ``node`` does to the values of the graph it is in, its bodies' nodes included: (in-place input name ->
    (cache_layout, layer_idx) pairs written, names whose data is read, names used). A node's read of what it writes
    itself is its write; the names used order it after their producers (a body's use of an outer value is an input
    of the node holding the body)."""
    own = set(writes_of(node))
    writes = {name: {(_attribute(node, "cache_layout"), _attribute(node, "layer_idx"))} for name in own}
    used = set(node.input) - {""}
    reads = set() if (node.domain, node.op_type) in METADATA_READERS else used - own
    for body in subgraphs(node):
        local = defined(body)
        for inner in body.node:
            inner_writes, inner_reads, inner_used = _effects(inner, writes_of)
            for name, places in inner_writes.items():
                if name not in local:
                    writes.setdefault(name, set()).update(places)
            reads |= inner_reads - local
            used |= inner_used - local
    return writes, reads, used


def _name(node) -> str:
    return f"{node.op_type} node {node.name or '(unnamed)'}"


def _describe(node, places) -> str:
    inside = " inside it" if _has_bodies(node) else ""
    return f"{_name(node)} (layer_idx {', '.join(str(layer) for layer in sorted({p[1] for p in places}))}{inside})"


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


def _check_reads(graph, effects, writers) -> None:
    for index, (writes, reads, _) in enumerate(effects):
        node = graph.node[index]
        passed = sorted(set(node.input) & set(writes)) if _has_bodies(node) else []
        if passed:
            name = passed[0]
            raise ValueError(
                f"{_name(node)} passes {name!r} into its body as an input, and a node inside writes it in place: the "
                "body's reads of that input may see the cache before or after the write (ONNX Runtime hands the body "
                "the same buffer). Read the writing op's outputs instead")
        for name in sorted(reads & set(writers)):
            other = next((i for i in writers[name] if i != index), None)
            if other is not None:
                where = "" if name in node.input else " inside it"
                raise ValueError(
                    f"{_name(node)} reads {name!r}{where}, which {_describe(graph.node[other], effects[other][0][name])} "
                    "writes in place: ONNX orders nodes only by data, so the read may see the cache before or after "
                    "the write. Read the op's outputs instead, or run the read in another model")


def _check_writes(graph, effects, writers) -> None:
    consumers = {}
    for index, (_, _, used) in enumerate(effects):
        for name in used:
            consumers.setdefault(name, []).append(index)
    for name, indices in writers.items():
        for first, second in itertools.combinations(indices, 2):
            a, b = graph.node[first], graph.node[second]
            places_a, places_b = effects[first][0][name], effects[second][0][name]
            layouts = sorted({p[0] for p in places_a | places_b})
            if len(layouts) > 1:
                raise ValueError(
                    f"{_describe(a, places_a)} and {_describe(b, places_b)} write {name!r} in different layouts "
                    f"(cache_layout {layouts[0]} and {layouts[1]}), so the layers of one overlap the other's: a cache "
                    "has one layout")
            common = places_a & places_b
            if common and not (_reaches(graph, first, second, consumers) or _reaches(graph, second, first, consumers)):
                raise ValueError(
                    f"{_describe(a, places_a)} and {_describe(b, places_b)} both write layer {min(common)[1]} of "
                    f"{name!r} and no data path orders them: ONNX Runtime may run them in either order. Put them in "
                    "separate models (or runs), or write different layers")


def check_write_order(graph, writes_of) -> None:
    """``writes_of(node)``: the in-place input names ``node`` itself writes. Raises ``ValueError`` naming the nodes
    when the rules above are broken in ``graph`` or in any body of its nodes."""
    effects = [_effects(node, writes_of) for node in graph.node]
    writers = {}  # name -> indices (in graph.node) of the nodes writing it
    for index, (writes, _, _) in enumerate(effects):
        for name in writes:
            writers.setdefault(name, []).append(index)
    _check_reads(graph, effects, writers)
    _check_writes(graph, effects, writers)
    for node in graph.node:
        for body in subgraphs(node):
            check_write_order(body, writes_of)
