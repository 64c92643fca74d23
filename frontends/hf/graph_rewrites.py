"""Graph rewrites applied to every exported decoder, whatever its family: onnxscript's ONNX Runtime fusions (RMS
norms, and residual adds with them, to ``SimplifiedLayerNormalization``/``SkipSimplifiedLayerNormalization``),
sibling MatMuls fused: the MatMuls that multiply one tensor by constant weights (q/k/v, gate/up) become one MatMul
over the concatenated weights and a Split, so a decode step reads its activations once and runs one kernel; and
rotary embeddings as ONNX Runtime's RotaryEmbedding over constant tables (``rotary_fusion``); and the packed batch's
one row taken with a Squeeze rather than a copying Gather."""

from __future__ import annotations

import collections
import gc

import numpy as np
import onnx
import onnx_ir as ir

from ..torch.model_files import forget_removed_inputs
from .graph_values import new_initializer
from .rotary_fusion import fuse_rotary_embeddings


def _matrix_kind(value):
    """``(K, dtype)`` of the 2-D constant ``[K, N]`` a MatMul multiplies by (weights of one kind concatenate), or
    None."""
    tensor = value.const_value if value is not None else None
    return (tensor.shape[0], tensor.dtype) if tensor is not None and len(tensor.shape) == 2 else None


def fuse_sibling_matmuls(model: ir.Model) -> int:
    """Replaces each group of 2+ MatMuls sharing their first input and multiplying it by constant ``[K, N_i]``
    weights of one dtype by one MatMul over ``[K, sum N_i]`` and a Split on the last axis (a MatMul whose output is a
    graph output keeps its name, and stays); returns how many groups were fused. The outputs are the same numbers
    (each output column is the same dot product). A weight no node reads any more leaves the initializers as soon as
    its group is fused, so that, where nothing else holds it, its memory is freed before the next group's copy is
    made."""
    graph = model.graph
    groups = collections.defaultdict(lambda: collections.defaultdict(list))  # x -> (K, dtype) -> MatMuls
    for node in graph:
        if node.op_type == "MatMul" and node.domain == "" and len(node.inputs) == 2:
            kind = _matrix_kind(node.inputs[1])
            if kind is not None:  # the nodes alone are kept: a weight is held by the graph only
                groups[node.inputs[0]][kind].append(node)
    outputs = set(graph.outputs)
    order = {node: i for i, node in enumerate(graph)}  # insertions below keep the order of the nodes already there
    fused = 0
    for x, by_kind in groups.items():
        for nodes in by_kind.values():
            nodes = [node for node in nodes if node.outputs[0] not in outputs]  # names kept
            if len(nodes) < 2:
                continue
            replaced = [node.inputs[1] for node in nodes]
            widths = [value.const_value.shape[1] for value in replaced]
            combined = new_initializer(graph, f"{nodes[0].name or 'matmul'}_fused_weight",
                                       np.concatenate([value.const_value.numpy() for value in replaced], axis=1))
            sizes = new_initializer(graph, f"{nodes[0].name or 'matmul'}_fused_split", np.array(widths, np.int64))
            matmul = ir.Node("", "MatMul", inputs=[x, combined], name=f"{nodes[0].name}_fused")
            split = ir.Node("", "Split", inputs=[matmul.outputs[0], sizes], attributes=[ir.AttrInt64("axis", -1)],
                            num_outputs=len(nodes), name=f"{nodes[0].name}_fused_split")
            first = min(nodes, key=order.__getitem__)
            graph.insert_before(first, [matmul, split])
            for node, out in zip(nodes, split.outputs):
                out.shape, out.type = node.outputs[0].shape, node.outputs[0].type
                ir.convenience.replace_all_uses_with(node.outputs[0], out)
            graph.remove(nodes, safe=True)
            _drop_unused(graph, replaced)
            fused += 1
    return fused


def squeeze_unit_gathers(model: ir.Model) -> int:
    """Replaces each ``Gather(x, 0)`` on axis 0 of an ``x`` whose first dimension is 1 (the packed batch's one row,
    taken apart for the attention ops) by ``Squeeze(x, [0])``: the same values, without the copy a Gather makes
    (ONNX Runtime's Squeeze reuses its input's buffer). Returns how many were replaced."""
    graph = model.graph
    if model.opset_imports.get("", 0) < 13:  # Squeeze takes its axes as an input from opset 13
        return 0
    axes = None
    replaced = 0
    for node in list(graph):
        if node.op_type != "Gather" or node.domain != "" or len(node.inputs) != 2:
            continue
        axis = node.attributes.get("axis")
        index = node.inputs[1].const_value if node.inputs[1] is not None else None
        shape = node.inputs[0].shape
        if (axis is not None and axis.as_int() != 0) or index is None or index.numpy().shape != () or \
                int(index.numpy()) not in (0, -1) or shape is None or len(shape) < 1 or shape[0] != 1:
            continue
        if node.outputs[0].is_graph_output():  # a graph output keeps its name
            continue
        if axes is None:
            axes = new_initializer(graph, "unit_gather_axes", np.array([0], np.int64))
        squeeze = ir.Node("", "Squeeze", inputs=[node.inputs[0], axes], name=f"{node.name}_squeeze")
        graph.insert_before(node, squeeze)
        squeeze.outputs[0].shape, squeeze.outputs[0].type = node.outputs[0].shape, node.outputs[0].type
        ir.convenience.replace_all_uses_with(node.outputs[0], squeeze.outputs[0])
        graph.remove(node, safe=True)
        replaced += 1
    return replaced


# onnxscript's ONNX Runtime fusions the exported decoders take: norms (and residual adds with them) and GELU. Not its
# rotary fusions: with the packed batch's computed cos/sin they make com.microsoft RotaryEmbedding nodes whose
# caches are not constant, which ONNX Runtime's CUDA EP refuses ("Updating cos_cache and sin_cache ... is not
# currently supported"); whether they match depends on the torch and transformers versions that traced the graph.
# Nor its attention fusions: attention is our ops already.
FUSIONS = ("fuse_erfgelu", "fuse_rms_normalization", "fuse_skip_layer_normalization", "fuse_skip_rms_normalization",
           "fuse_gelu", "fuse_bias_gelu")


SKIP_NORMS = ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")


def _fused(model: ir.Model, fusions, core) -> tuple:
    """``(model, counts)``: onnxscript's ONNX Runtime fusions named in ``fusions`` applied to ``model`` in place (its
    pre-optimization first and its optimization after, as its own pipeline runs them)."""
    model, counts = core._pre_optimize(model), {}
    # The fusions only: optimize_for_ort's FusedMatMul rules also fold transposes into batched MatMuls that ONNX
    # Runtime's CPU kernel then refuses for these graphs (and ONNX Runtime folds them itself at load).
    for name in fusions:
        count = getattr(core, name)(model)
        if count:
            counts[name.removeprefix("fuse_")] = count
    core.optimize(model)
    return model, counts


def _mixed_skip_norms(model: ir.Model) -> int:
    """How many Skip*Normalization nodes take an input, skip and gamma of more than one element type (ONNX Runtime
    binds them to one type parameter)."""
    return sum(1 for node in model.graph.all_nodes() if node.op_type in SKIP_NORMS
               and len({v.dtype for v in node.inputs[:3] if v is not None}) > 1)


def optimize_decoder(proto: onnx.ModelProto, max_positions: int = 0) -> tuple:
    """``(model, counts)``: ``proto`` with onnxscript's ONNX Runtime fusions in :data:`FUSIONS`,
    :func:`fuse_sibling_matmuls`, with ``max_positions`` (the positions the model takes) rotary embeddings as
    ONNX Runtime's RotaryEmbedding (:func:`~kvcache_op.hf.rotary_fusion.fuse_rotary_embeddings`), and
    :func:`squeeze_unit_gathers` applied, and how many of each were made. The graph's inputs, outputs, custom ops
    and metadata are kept; every op it holds runs on ONNX Runtime's CPU and CUDA EPs."""
    model, counts = optimized_ir(proto, max_positions)
    return ir.to_proto(model), counts


def optimized_ir(model, max_positions: int = 0) -> tuple:
    """:func:`optimize_decoder`'s ``(model, counts)`` with the model in onnx_ir. ``model`` is a ModelProto (the result
    shares its weights: saved with ``ir.save``, no second copy of every weight is made in memory) or an onnx_ir model,
    which the rewrite takes over (use the returned one): the weights a rewrite replaces leave it as it goes, so that
    where nothing else holds them they are freed."""
    import warnings

    import onnxscript
    import onnxscript.optimizer
    from onnxscript.rewriter.ort_fusions import _core

    from .. import spec  # noqa: F401 - our ops' schemas, for the shape inference the fusions run

    if isinstance(model, onnx.ModelProto):
        model = ir.from_proto(model)
    # The fusion functions are onnxscript's own module-level names (0.7.x); another version may name them otherwise.
    # They only make the graph faster, so without them the export goes on with a warning naming what is missing.
    missing = [name for name in ("_pre_optimize", "optimize", *FUSIONS) if not hasattr(_core, name)]
    if missing:
        warnings.warn(f"onnxscript {onnxscript.__version__} has no {', '.join(missing)} in its ONNX Runtime fusions: "
                      f"the exported graph keeps its norms unfused", stacklevel=2)
        counts = {}
        onnxscript.optimizer.optimize(model)  # constants folded: the weights the sibling MatMuls multiply by
    else:
        unfused = model.clone()  # sharing its tensors: for a second try, below
        model, counts = _fused(model, FUSIONS, _core)
        mixed = _mixed_skip_norms(model)
        if mixed:
            # A norm computed in float32 over a float16 residual (Gemma's, OLMo 2's, in a float16 model) fuses into a
            # Skip*Normalization whose inputs differ in type, which ONNX Runtime refuses: those models keep their
            # residual adds apart from their norms.
            model, counts = _fused(unfused, [n for n in FUSIONS if "skip" not in n], _core)
            counts["skip_norms_left_unfused"] = mixed
        del unfused  # it holds the weights the optimization replaced (folded transposes)
    forget_removed_inputs(model)  # the shape inference the optimizer ran
    gc.collect()  # the optimizer's removed values and nodes hold the weights it replaced, in reference cycles
    counts["sibling_matmuls"] = fuse_sibling_matmuls(model)
    if max_positions:
        counts["rotary_embeddings"] = fuse_rotary_embeddings(model, max_positions)
    counts["unit_gathers"] = squeeze_unit_gathers(model)
    counts["unused_initializers"] = drop_unused_initializers(model)
    return model, counts


def drop_unused_initializers(model: ir.Model) -> int:
    """Removes the initializers no node reads that are neither graph inputs nor outputs (the weights a rewrite
    replaced: the rotary inverse frequencies before their tables, constants folding left behind), and returns how
    many. Left in, they made the file larger (about 30% of a tiny Llama's bytes) and ONNX Runtime warn of each at
    load. Only initializers: a node whose outputs nothing reads may still write a cache in place."""
    return _drop_unused(model.graph, list(model.graph.initializers.values()))


def _drop_unused(graph: ir.Graph, values: list) -> int:
    """Removes those of ``values`` that are initializers no node reads and neither graph inputs nor outputs; returns
    how many."""
    kept = frozenset(graph.inputs) | frozenset(graph.outputs)
    unused = [value.name for value in values
              if graph.initializers.get(value.name) is value and not value.uses() and value not in kept]
    for name in unused:
        del graph.initializers[name]
    return len(unused)
