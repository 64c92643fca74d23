"""The graph-input rule for the ops' in-place inputs, checked on a model before a session runs it.

KeyValueCache and MultiHeadCacheAttention write their ``cache`` and ``scale`` inputs, KeyCacheRotaryShift
its ``cache`` and ``scale``, in place. Those inputs must be fed directly by a graph input that has no initializer of
the same name: only then do the writes land in the caller's buffer. Anything else — a constant
initializer, an initializer behind ``Identity``/``Reshape`` (with graph optimizations off ONNX
Runtime keeps such a node, and the "constant" then keeps the previous run's writes), an initializer
that is also a graph input (its default), or any other node's output — is refused. With
``quant_bit`` 0 the ops never write ``scale`` (an empty one is ppl.pmx's placeholder for "no scale"), so
whatever feeds it is let be: the op itself refuses a non-empty one. The write-order rule
(:mod:`.write_order`) is checked with it. A node inside a model-local function is checked as ONNX Runtime runs it:
inlined where the function is called (:func:`as_run`), its cache the call's argument.
"""

import onnx
import onnx.inliner

from ..spec import mha_schema, mhca_schema, rotary_schema, schema
from ..spec.schema import DOMAIN
from .write_order import check_write_order, defined, subgraphs

#: The package's op types (in :data:`DOMAIN`): ONNX Runtime runs their kernels whatever a model-local function of the
#: same name says.
OP_TYPES = {schema.OP_TYPE, rotary_schema.OP_TYPE, mha_schema.OP_TYPE, mhca_schema.OP_TYPE}

#: (domain, op type) -> positions of the inputs the op writes in place.
IN_PLACE_INPUTS = {
    (DOMAIN, "KeyValueCache"): {8: "cache", 9: "scale"},
    (DOMAIN, "MultiHeadCacheAttention"): {10: "cache", 11: "scale"},
    (DOMAIN, "KeyCacheRotaryShift"): {0: "cache", 1: "scale"},
}


def _quant_bit(node) -> int:
    for attribute in node.attribute:
        if attribute.name == "quant_bit":
            return attribute.i
    return 0


# An ONNX Runtime format model is a flatbuffer: a little-endian root offset, then this file identifier (bytes 4-8).
# An ONNX file is a protobuf whose first byte is 0x08 (ir_version's tag), where "ORTM" can also stand at bytes 4-8
# (a producer name "ORTModule").
ORT_FORMAT_IDENTIFIER = b"ORTM"


def load_model(model) -> onnx.ModelProto:
    """A ModelProto from a ModelProto, serialized bytes or a path (read once; external data is not loaded).
    ``ValueError`` for an ONNX Runtime format (``.ort``) model, whose graph this package cannot read to check."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        data, what = bytes(model), "the model bytes"
    else:
        with open(model, "rb") as stream:
            data, what = stream.read(), str(model)
    if data[4:8] == ORT_FORMAT_IDENTIFIER and data[:1] != b"\x08":
        raise ValueError(f"{what}: an ONNX Runtime format (.ort) model, which the package cannot read to check its "
                         "graph before running it; pass the .onnx file it was converted from (a plain "
                         "onnxruntime.InferenceSession runs .ort files unchecked)")
    return onnx.load_from_string(data)


def as_run(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as ONNX Runtime runs it: each call of a model-local function replaced by the function's body, its
    attribute references resolved and its opset converted to the model's (onnx's inliner; ONNX Runtime inlines them
    when it loads a model), so the rules see the nodes that run and what feeds them: a cache written inside a
    function is the call's argument. The model itself where it has no functions. The initializers keep only their
    names, types and shapes (the rules read no values), so a large model's weights are not copied. ``ValueError``
    where a function that reaches an op of this package could not be inlined (its writes could not be checked), or
    where one has the name of an op of this package (ONNX Runtime runs the op's kernel, not the function)."""
    if not model.functions:
        return model
    for function in model.functions:
        if function.domain == DOMAIN and function.name in OP_TYPES:
            raise ValueError(f"model-local function {DOMAIN}::{function.name} has the name of an op of this package: "
                             "ONNX Runtime runs the op's kernel, not the function, so the checks cannot take the "
                             "function's body for what runs; rename the function")
    shell = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    imported = {entry.domain for entry in model.opset_import}
    for function in model.functions:  # a domain only a function imports (ONNX Runtime takes it from there)
        for entry in function.opset_import:
            if entry.domain not in imported:
                shell.opset_import.append(entry)
                imported.add(entry.domain)
    graph = shell.graph
    graph.name = model.graph.name
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    for initializer in model.graph.initializer:
        graph.initializer.add(name=initializer.name, data_type=initializer.data_type, dims=initializer.dims)
    for sparse in model.graph.sparse_initializer:  # its values' name is the initializer's
        graph.sparse_initializer.add().values.CopyFrom(onnx.TensorProto(name=sparse.values.name,
                                                                        data_type=sparse.values.data_type))
    _given_defaults(shell)
    try:
        inlined, failure = onnx.inliner.inline_local_functions(shell, convert_version=True), "it was left as a call"
    except Exception as error:  # noqa: BLE001 - whatever the inliner's C++ raises, the check below decides
        inlined, failure = model, f"onnx's inliner: {error}"
    functions = {(f.domain, f.name): f for f in model.functions}
    left = {(n.domain, n.op_type) for n in _nodes(inlined.graph)} & set(functions)
    for key in sorted(left):
        if _reaches_our_ops(functions[key], functions, set()):
            raise ValueError(f"model-local function {key[0]}::{key[1]} reaches an op of this package, and could not be "
                             f"inlined as ONNX Runtime runs it ({failure}), so what its ops write in place cannot be "
                             "checked: inline it before saving (onnx.inliner.inline_local_functions(model, "
                             "convert_version=True))")
    return inlined


def _given_defaults(model: onnx.ModelProto) -> None:
    """Gives each call of a model-local function the function's default attribute values (``attribute_proto``) it
    does not set, as ONNX Runtime applies them: onnx's inliner drops an attribute reference to an unset attribute, so
    a ``layer_idx`` or ``quant_bit`` taken from a default would be checked as the op's own default."""
    defaults = {(f.domain, f.name, f.overload): f.attribute_proto for f in model.functions if f.attribute_proto}
    if not defaults:
        return
    for body in (model.graph, *model.functions):
        for node in _nodes(body):
            given = {attribute.name for attribute in node.attribute}
            for default in defaults.get((node.domain, node.op_type, node.overload), ()):
                if default.name not in given:
                    node.attribute.append(default)


def _reaches_our_ops(function, functions: dict, seen: set) -> bool:
    """Whether ``function`` (or a model-local function it calls) has a node of this package's domain."""
    seen.add((function.domain, function.name))
    for node in _nodes(function):
        if node.domain == DOMAIN:
            return True
        callee = functions.get((node.domain, node.op_type))
        if callee is not None and (callee.domain, callee.name) not in seen and \
                _reaches_our_ops(callee, functions, seen):
            return True
    return False


def _nodes(graph):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies)."""
    for node, _ in _scoped_nodes(graph):
        yield node


def _scoped_nodes(graph, hidden=frozenset()):
    """(node, the names the bodies around it define) for every node of ``graph`` and of its subgraphs: inside a body,
    those names are the body's own values, not the model's values of the same name."""
    for node in graph.node:
        yield node, hidden
        for body in subgraphs(node):
            yield from _scoped_nodes(body, hidden | defined(body))


def _written_inputs(node):
    """(role, input name) of each input ``node`` writes in place."""
    positions = IN_PLACE_INPUTS.get((node.domain, node.op_type), {})
    for position, role in positions.items():
        if position >= len(node.input) or not node.input[position]:
            continue  # an absent optional scale
        if role == "scale" and _quant_bit(node) == 0:
            continue  # never written
        yield role, node.input[position]


def check_attribute_names(model) -> None:
    """``ValueError`` naming the node when an op of this package carries an attribute its schema does not know
    (``pagesize`` for ``page_size``): ONNX Runtime offers kernels no way to list a node's attributes, so the op
    itself cannot see it, and would run with the default of the attribute meant. Also when the model does not
    import the op's domain at a version of at least 1 (which onnx's checker refuses or skips the schema at). Nodes
    inside model-local functions are checked where they are called (:func:`as_run`)."""
    from onnx import defs

    model = as_run(load_model(model))
    imported = {entry.domain: entry.version for entry in model.opset_import}
    for node in _nodes(model.graph):
        if not node.domain == DOMAIN or not defs.has(node.op_type, node.domain):
            continue
        if imported.get(node.domain, 0) < 1:
            # ONNX Runtime runs a node whose domain is not imported, and at version 0 says only "KeyValueCache(-1) is
            # not a registered function/op"; onnx's checker refuses the first and skips the schema at the second.
            said = f"gives {node.domain} version 0" if node.domain in imported else f"lacks {node.domain}"
            raise ValueError(f"{node.op_type} node {node.name or '(unnamed)'}: the model's opset_import {said}; import "
                             f"it at version 1 (onnx.helper.make_opsetid({node.domain!r}, 1))")
        known = set(defs.get_schema(node.op_type, node.domain).attributes)
        unknown = sorted(a.name for a in node.attribute if a.name not in known)
        if unknown:
            raise ValueError(f"{node.op_type} node {node.name or '(unnamed)'}: unknown attribute(s) {unknown}; "
                             f"the op's attributes are {sorted(known)}")


def in_place_inputs(model) -> set:
    """Names of the graph inputs the model's ops write in place. Raises ``ValueError`` naming the node
    and input when one of those inputs is not fed directly by a graph input without an initializer, or
    when the order of the writes (or of a read of a written input) is left to the runtime. Nodes inside model-local
    functions are checked where they are called (:func:`as_run`)."""
    model = as_run(load_model(model))
    graph = model.graph
    initializers = {init.name for init in graph.initializer} | {init.values.name for init in graph.sparse_initializer}
    graph_inputs = {value.name for value in graph.input}
    names = set()
    for node, hidden in _scoped_nodes(graph):
        for role, name in _written_inputs(node):
            where = f"{node.op_type} node {node.name or '(unnamed)'}: {role} {name!r}"
            if name in hidden and (name in graph_inputs or name in initializers):
                raise ValueError(f"{where} is a value of the subgraph around it (a body input, initializer or node "
                                 "output), not the graph input of that name, but the op writes it in place: the writes "
                                 "would land in the body's value; give it another name and write the graph input")
            if name in initializers:
                raise ValueError(f"{where} is an initializer, but the op writes it in place: make it a graph input "
                                 "without an initializer and bind your own buffer")
            if name not in graph_inputs:
                raise ValueError(f"{where} is computed by another node, but the op writes it in place: feed it "
                                 "directly from a graph input (the writes would land in an intermediate tensor)")
            names.add(name)
    check_write_order(graph, lambda node: [name for _, name in _written_inputs(node)])
    return names


def onnxruntime_release(version: str = None) -> tuple:
    """``(major, minor)`` of ``version`` (default: the onnxruntime imported), or None where it does not start so."""
    import re

    if version is None:
        import onnxruntime

        version = onnxruntime.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    return tuple(map(int, found.groups())) if found else None


#: onnxruntime before this crashes the process creating a session of a MultiHeadCacheAttention node given an
#: ``attn_mask`` but no ``scale`` (an optional input left empty before one that is given): seen in 1.22 and 1.23.
_EMPTY_SCALE_BEFORE_MASK_LOADS = (1, 24)


def refuse_crashing_nodes(model, version: str = None) -> None:
    """``RuntimeError`` naming the node and the release needed where the onnxruntime imported (or ``version``) would
    crash the process creating a session of ``model``. pip holds the ``onnxruntime`` distribution to the package's
    floor, not ``onnxruntime-gpu`` (another distribution of the same module)."""
    release = onnxruntime_release(version)
    if release is None or release >= _EMPTY_SCALE_BEFORE_MASK_LOADS:
        return
    model = load_model(model)
    for node in (node for body in (model.graph, *model.functions) for node in _nodes(body)):  # functions' too
        if node.domain == DOMAIN and node.op_type == "MultiHeadCacheAttention" and \
                len(node.input) > 12 and not node.input[11] and node.input[12]:
            needed = ".".join(map(str, _EMPTY_SCALE_BEFORE_MASK_LOADS))
            raise RuntimeError(
                f"MultiHeadCacheAttention node {node.name or '(unnamed)'}: onnxruntime "
                f"{'.'.join(map(str, release))} crashes creating a session of this node (an attn_mask given, no "
                f"scale): it needs onnxruntime >= {needed} (pip install 'onnxruntime>=1.26', or "
                "'onnxruntime-gpu>=1.26' for the CUDA execution provider)")
