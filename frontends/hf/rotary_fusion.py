"""Rotary embeddings as ONNX Runtime's ``com.microsoft::RotaryEmbedding``, for every family that rotates by halves.

A traced model applies RoPE as ``x * cos + rotate_half(x) * sin``: a Slice/Neg/Concat/Mul/Add chain per query and
key of every layer, fed by cos/sin computed from the positions each step. This rewrite finds that chain by its
arithmetic, not by a family's name, and replaces it with one ``RotaryEmbedding`` node over constant cos/sin tables.

The tables are not derived from a formula: the graph's own subgraph from ``positions`` to ``cos``/``sin`` is run in
ONNX Runtime on every position up to the model's maximum, so scaling variants (linear, YaRN's attention factor,
Llama 3's frequency bands, Gemma 3's two rotaries) come out as the model computes them. A chain is left as it is
unless that subgraph depends on ``positions`` alone, gives one row per position (checked on positions out of order),
and repeats its first half in its second (rotation by halves). Interleaved rotaries (GPT-J, Cohere) do not match
and stay unfused.

ONNX Runtime's RotaryEmbedding looks its rows up by position, so the fused graph takes positions in
``[0, max_positions)`` (the CPU kernel refuses others with an error; the engine never feeds them), and it reads a
run's tokens as one sequence, which it refuses when longer than its tables: at most ``max_positions`` tokens a run
(the engine's token budget stays within them).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir

from .graph_values import new_initializer

POSITIONS = "positions"
# Tables above this many bytes (both together) are not built: the chain stays as it is.
TABLE_LIMIT = 256 << 20


def _const(value):
    """The constant array behind ``value`` (an initializer), or None."""
    if value is None or value.const_value is None:
        return None
    return value.const_value.numpy()


def _producer(value, op_type: str):
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _last_axis(axis, rank) -> bool:
    return axis == -1 or (rank is not None and axis == rank - 1)


def _rank(value):
    return len(value.shape) if value.shape is not None else None


def _slice_of(value):
    """``(source, start, end)`` when ``value`` is a unit-step Slice of ``source`` on its last axis, else None."""
    node = _producer(value, "Slice")
    if node is None or len(node.inputs) < 4:
        return None
    rank = _rank(node.inputs[0])
    starts, ends, axes = (_const(v) for v in node.inputs[1:4])
    steps = _const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else np.ones(1, np.int64)
    if any(a is None or a.size != 1 for a in (starts, ends, axes, steps)):
        return None
    if int(steps[0]) != 1 or not _last_axis(int(axes[0]), rank):
        return None
    return node.inputs[0], int(starts[0]), int(ends[0])


def _rotate_half_source(value):
    """``(x, half, upper_end, nodes)`` when ``value = Concat(-x[..., half:upper_end], x[..., :half])`` on the last
    axis, else None (the caller checks ``upper_end`` reaches x's width)."""
    concat = _producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2:
        return None
    neg = _producer(concat.inputs[0], "Neg")
    if neg is None:
        return None
    upper, lower = _slice_of(neg.inputs[0]), _slice_of(concat.inputs[1])
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    x = upper[0]
    axis = concat.attributes.get("axis")
    if axis is None or not _last_axis(axis.as_int(), _rank(x)):
        return None
    half = upper[1]
    if lower[1] != 0 or lower[2] != half or half <= 0:
        return None
    return x, half, upper[2], [concat, neg, neg.inputs[0].producer(), concat.inputs[1].producer()]


def _match(add):
    """``(x, cos, sin, half, upper_end, nodes)`` for ``add = x * cos + rotate_half(x) * sin`` (either order of every
    operand), else None."""
    if len(add.inputs) != 2:
        return None
    muls = [_producer(v, "Mul") for v in add.inputs]
    if None in muls:
        return None
    for mul_cos, mul_sin in (muls, muls[::-1]):
        for rotated, sin in (mul_sin.inputs, mul_sin.inputs[::-1]):
            found = _rotate_half_source(rotated)
            if found is None:
                continue
            x, half, upper_end, nodes = found
            for plain, cos in (mul_cos.inputs, mul_cos.inputs[::-1]):
                if plain is x:
                    return x, cos, sin, half, upper_end, [add, mul_cos, mul_sin, *nodes]
    return None


def _position_subgraph(values):
    """The nodes (graph order unknown) computing ``values`` from ``positions`` and constants, or None when they
    read anything else (another graph input, a subgraph)."""
    nodes, seen, stack = {}, set(), list(values)
    while stack:
        value = stack.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        node = value.producer()
        if node is None:
            if value.is_graph_input():  # positions, or an initializer a caller may feed another value for
                if value.name == POSITIONS:
                    continue
                return None
            if value.const_value is None:
                return None
            continue
        if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
            return None
        nodes[id(node)] = node
        stack.extend(node.inputs)
    return list(nodes.values())


def _topological(nodes) -> list:
    """``nodes`` ordered so each comes after those producing its inputs (a rewritten graph's own order need not be)."""
    members, placed, ordered = {id(n) for n in nodes}, set(), []

    def place(node):
        if id(node) in placed:
            return
        placed.add(id(node))
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and id(producer) in members:
                place(producer)
        ordered.append(node)

    for node in nodes:
        place(node)
    return ordered


def _evaluate(model: ir.Model, graph_nodes, outputs, positions: np.ndarray) -> list:
    """Runs the subgraph ``graph_nodes`` (which read ``positions`` and constants) in ONNX Runtime's CPU EP."""
    import onnxruntime as ort

    ordered = _topological(graph_nodes)
    inits = {}
    for node in ordered:
        for value in node.inputs:
            if value is not None and value.producer() is None and value.const_value is not None:
                tensor = ir.serde.serialize_tensor(value.const_value)
                tensor.name = value.name  # a folded constant's tensor may carry another name than its value
                inits[value.name] = tensor
    protos = [ir.serde.serialize_node(node) for node in ordered]
    names = [f"out_{i}" for i in range(len(outputs))]
    protos += [onnx.helper.make_node("Identity", [value.name], [name]) for value, name in zip(outputs, names)]
    graph = onnx.helper.make_graph(
        protos, "rotary_tables",
        [onnx.helper.make_tensor_value_info(POSITIONS, onnx.TensorProto.INT64, [None])],
        [onnx.helper.make_tensor_value_info(name, int(value.dtype), None) for value, name in zip(outputs, names)],
        list(inits.values()))
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=model.ir_version)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(names, {POSITIONS: positions.astype(np.int64)})


def _rows(full: np.ndarray, sample: np.ndarray, count: int, width: int, positions: np.ndarray):
    """``full`` (evaluated on ``arange(count)``) as ``[count, width]`` rows when its only axis that follows the
    positions is the second-to-last and its others are 1, and ``sample`` (evaluated on ``positions``) is those rows
    looked up; else None."""
    if full.ndim < 2 or full.shape[-1] != width or full.shape[-2] != count or sample.shape[-2] != len(positions):
        return None
    if any(d != 1 for d in full.shape[:-2]) or full.shape[:-2] != sample.shape[:-2]:
        return None
    rows = full.reshape(count, width)
    if not _close(rows[positions], sample.reshape(len(positions), width)):
        return None  # not one row per position: leave the chain as it is
    return rows


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal within a few units in the last place: ONNX Runtime's vectorized Cos/Sin may round an element
    differently by where it sits in the array, so the graph itself does not give a position bit-identical rows."""
    tolerance = 4 * np.finfo(a.dtype).eps * max(1.0, float(np.abs(a).max(initial=0)))
    return bool(np.allclose(a, b, rtol=0, atol=tolerance))


def _tables(model, cos, sin, width: int, max_positions: int):
    """The ``[max_positions, width / 2]`` cos and sin tables behind ``cos``/``sin`` (each ``[..., T, width]``), or
    None when they are not per-position functions of ``positions`` repeating their first half."""
    nodes = _position_subgraph([cos, sin])
    if nodes is None or width % 2 or cos.dtype is None or sin.dtype is None:
        return None
    if 2 * max_positions * (width // 2) * max(cos.dtype.itemsize, sin.dtype.itemsize) > TABLE_LIMIT:
        return None
    last = max_positions - 1
    # Positions out of order, with both ends of the table and without them: rows that depend on the other positions
    # of the batch (its largest, its smallest) differ from the table's in one of them.
    samples = [np.unique(np.array([last, 0, last // 2, min(1, last), last // 3]))[::-1].copy(),
               np.unique(np.array([last // 2, (last + 1) // 3]))[::-1].copy()]
    try:
        full = _evaluate(model, nodes, [cos, sin], np.arange(max_positions))
        parts = [_evaluate(model, nodes, [cos, sin], sample) for sample in samples]
    except Exception as error:  # noqa: BLE001 - the chain then stays as traced, and the export says so
        warnings.warn(f"rotary embeddings left unfused: their cos/sin subgraph did not run alone in ONNX Runtime "
                      f"({type(error).__name__}: {error})", stacklevel=3)
        return None
    tables = []
    for k, whole in enumerate(full):
        rows = [_rows(whole, part[k], max_positions, width, sample) for part, sample in zip(parts, samples)]
        if any(r is None for r in rows) or not _close(rows[0][:, :width // 2], rows[0][:, width // 2:]):
            return None
        tables.append(np.ascontiguousarray(rows[0][:, :width // 2]))
    return tables


def _dims(value):
    """``value``'s rank-4 shape with None for a dimension that is not a constant (the tokens), or None."""
    shape = value.shape
    if shape is None or len(shape) != 4:
        return None
    return tuple(d if isinstance(d, int) else None for d in shape)


def fuse_rotary_embeddings(model: ir.Model, max_positions: int) -> int:
    """Replaces every ``x * cos + rotate_half(x) * sin`` over a ``[1, heads, tokens, width]`` ``x`` whose cos/sin are
    per-position functions of the ``positions`` input by one ``com.microsoft::RotaryEmbedding`` over constant tables of
    ``max_positions`` rows; returns how many were replaced. A rotation of the leading part of each head (partial
    rotary) matches on that part. The outputs are the same rotation (ONNX Runtime computes it in the input's type)."""
    graph = model.graph
    positions = next((v for v in graph.inputs if v.name == POSITIONS), None)
    if positions is None or positions.dtype != ir.DataType.INT64 or max_positions < 1:
        return 0
    position_ids = None
    tables = {}
    fused, made = 0, []
    for add in list(graph):
        if add.op_type != "Add" or add.domain != "":
            continue
        found = _match(add) if not add.outputs[0].is_graph_output() else None  # a graph output keeps its name
        if found is None:
            continue
        x, cos, sin, half, upper_end, nodes = found
        dims = _dims(x)
        # [1, heads, tokens, width]: the tokens axis (where cos/sin's rows land) is the one the packed batch's
        # length sets, never a constant; the rotation keeps x's shape
        if dims is None or dims[0] != 1 or dims[1] is None or dims[2] is not None or dims[3] != 2 * half or \
                upper_end < dims[3] or add.outputs[0].shape != x.shape:
            continue
        key = (id(cos), id(sin))
        if key not in tables:  # once per cos/sin pair: the tables become initializers
            arrays = _tables(model, cos, sin, dims[3], max_positions)
            tables[key] = None if arrays is None else tuple(
                new_initializer(graph, f"rotary_{kind}_table", array) for kind, array in zip(("cos", "sin"), arrays))
        if tables[key] is None:
            continue
        cos_table, sin_table = tables[key]
        if position_ids is None:
            axes = new_initializer(graph, "rotary_position_axes", np.array([0], np.int64))
            unsqueeze = ir.Node("", "Unsqueeze", inputs=[positions, axes], name="rotary_position_ids")
            graph.insert_before(next(iter(graph)), unsqueeze)
            position_ids = unsqueeze.outputs[0]
        rotary = ir.Node("com.microsoft", "RotaryEmbedding", inputs=[x, position_ids, cos_table, sin_table],
                         name=f"{add.name}_rotary")
        graph.insert_before(add, rotary)
        made.append(rotary)
        out = rotary.outputs[0]
        out.shape, out.type = add.outputs[0].shape, add.outputs[0].type
        ir.convenience.replace_all_uses_with(add.outputs[0], out)
        for node in nodes:  # each after the nodes that read it: a node still read elsewhere stays
            if node is not None and not any(v.uses() or v.is_graph_output() for v in node.outputs):
                graph.remove(node, safe=True)
        fused += 1
    if fused:
        model.opset_imports.setdefault("com.microsoft", 1)
        _drop_unused(graph)
        drop_rotary_transposes(graph, made)
    return fused


def _drop_unused(graph) -> None:
    """Removes standard-domain nodes none of whose outputs is read (the cos/sin chains the tables replaced), last
    first. Custom ops are kept: ours write the cache in place."""
    for node in reversed(list(graph)):
        if node.domain == "" and not any(v.uses() or v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)


def _transpose(value, producer: bool):
    nodes = [value.producer()] if producer else [use.node for use in value.uses()]
    if not nodes or any(n is None or n.op_type != "Transpose" or n.domain != "" for n in nodes):
        return None
    perms = [n.attributes.get("perm") for n in nodes]
    if any(p is None or list(p.as_ints()) != [0, 2, 1, 3] for p in perms):
        return None
    return nodes


def drop_rotary_transposes(graph, rotaries: list) -> int:
    """Each of ``rotaries`` (RotaryEmbedding nodes with no attributes, over ``[1, heads, tokens, width]``) that sits
    between two ``[0, 2, 1, 3]`` Transposes (heads moved before tokens for it, then back) reads and writes
    ``[1, tokens, heads * width]`` instead, between free Reshapes; returns how many were changed."""
    changed = 0
    for rotary in rotaries:
        before = _transpose(rotary.inputs[0], producer=True)
        after = _transpose(rotary.outputs[0], producer=False)
        dims = _dims(rotary.inputs[0])
        if before is None or after is None or dims is None or len(rotary.inputs[0].uses()) != 1 or rotary.attributes \
                or any(node.outputs[0].is_graph_output() for node in [*before, *after]):
            continue
        heads, width = dims[1], dims[3]
        source = before[0].inputs[0]
        flatten = []
        flat_source = _unflattened(source, heads * width)
        if flat_source is None:  # [1, T, H, D] -> [1, T, H * D]
            flat = new_initializer(graph, f"{rotary.name}_flat_shape", np.array([0, 0, heads * width], np.int64))
            flatten = [ir.Node("", "Reshape", inputs=[source, flat], name=f"{rotary.name}_flatten")]
            flat_source = flatten[0].outputs[0]
        split = new_initializer(graph, f"{rotary.name}_head_shape", np.array([0, 0, heads, width], np.int64))
        rotated = ir.Node("com.microsoft", "RotaryEmbedding", inputs=[flat_source, *rotary.inputs[1:]],
                          attributes=[ir.AttrInt64("num_heads", heads)], name=rotary.name + "_tokens_major")
        unflatten = ir.Node("", "Reshape", inputs=[rotated.outputs[0], split], name=f"{rotary.name}_heads")
        graph.insert_before(rotary, [*flatten, rotated, unflatten])
        unflatten.outputs[0].shape, unflatten.outputs[0].type = after[0].outputs[0].shape, after[0].outputs[0].type
        for node in after:
            ir.convenience.replace_all_uses_with(node.outputs[0], unflatten.outputs[0])
        graph.remove([*after, rotary, before[0]], safe=True)
        changed += 1
    if changed:
        _drop_unused(graph)  # the [1, T, H, D] views nothing reads now
    return changed


def _unflattened(value, flat_width: int):
    """The ``[1, T, H * D]`` tensor ``value`` (``[1, T, H, D]``) is a Reshape of, so the rotation can read it
    directly, or None."""
    node = _producer(value, "Reshape")
    if node is None:
        return None
    source = node.inputs[0]
    shape, out = source.shape, value.shape
    if shape is None or out is None or len(shape) != 3 or shape[2] != flat_width or shape[0] != 1:
        return None
    return source if shape[1] == out[1] else None  # the same tokens dimension (symbolic dims compare by name)
