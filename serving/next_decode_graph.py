"""The exported decoder with its next decode step computed in the graph: each row's greedy token and the next
step's changing index inputs become graph outputs, so a run of greedy decode steps feeds each step's outputs to
the next step's inputs by binding (no host work between the steps but reading the tokens).

A decode step (one token per sequence, the page tables holding the following steps' pages) is followed by one whose
``input_ids`` are the tokens just chosen and whose ``positions``, ``start_pos`` and ``max_kvlen`` are one more, and
whose ``kvstarts`` grow by one per earlier sequence (``kvstarts + arange``): exactly what
:meth:`~kvcache_op.manager.StepPlan.next_decode` builds on the host.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .decoder_io import OUTPUT_NAME

#: The inputs a decode step planned ahead changes, each fed from the graph output ``NEXT_PREFIX + name``.
NEXT_DECODE_INPUTS = ("input_ids", "positions", "kvstarts", "start_pos", "max_kvlen")
NEXT_PREFIX = "next_"


#: The graph output holding each row's greedy token (:func:`with_greedy_tokens`, :func:`with_next_decode`).
GREEDY_TOKENS = NEXT_PREFIX + "input_ids"


def _check_free(graph, added: list) -> None:
    """``ValueError`` when the graph already has a value named as one of ``added``."""
    taken = ({value.name for value in graph.input} | {value.name for value in graph.output}
             | {name for node in graph.node for name in node.output})
    clash = sorted(taken.intersection(added))
    if clash:
        raise ValueError(f"the decoder already has values named {clash}: its next decode step cannot be added")


#: The largest finite float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _greedy_nodes(graph, clipped: bool = False) -> list:
    """The nodes computing :data:`GREEDY_TOKENS` from the logits: ArgMax over the vocabulary (the first of equal
    maxima), float16/bfloat16 logits widened to float32 first (which keeps their order). ``clipped``: the ArgMax
    reads the logits within +-FLOAT32_MAX (ONNX Runtime's CUDA ArgMax gives INT32_MAX for a row of -inf, whose token
    the host would then choose from a copy of the logits; clipped, such a row's token is 0, numpy's; an infinite
    logit stays the largest of its row, as float16 and bfloat16 hold no FLOAT32_MAX and a float32 row holding both is
    no model's)."""
    outputs = {value.name: value for value in graph.output}
    logits, nodes = OUTPUT_NAME, []
    if outputs[OUTPUT_NAME].type.tensor_type.elem_type != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [logits], [NEXT_PREFIX + "logits_f32"], to=TensorProto.FLOAT))
        logits = NEXT_PREFIX + "logits_f32"
    if clipped:
        limit = lambda name, value: helper.make_node(  # noqa: E731
            "Constant", [], [NEXT_PREFIX + name], value=helper.make_tensor(NEXT_PREFIX + name, TensorProto.FLOAT, [],
                                                                            [value]))
        nodes += [limit("lowest", -FLOAT32_MAX), limit("highest", FLOAT32_MAX),
                  helper.make_node("Clip", [logits, NEXT_PREFIX + "lowest", NEXT_PREFIX + "highest"],
                                   [NEXT_PREFIX + "logits_clipped"])]
        logits = NEXT_PREFIX + "logits_clipped"
    return nodes + [helper.make_node("ArgMax", [logits], [GREEDY_TOKENS], axis=1, keepdims=0)]


def _extended(model: onnx.ModelProto, nodes: list, outputs: list) -> onnx.ModelProto:
    """A copy of ``model`` with ``nodes`` appended and ``outputs`` (value infos) added to its graph's outputs."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.node.extend(nodes)
    result.graph.output.extend(outputs)
    return result


def with_greedy_tokens(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the exported decoder ``model`` with one more output, :data:`GREEDY_TOKENS` (int64, one per row of
    the logits): each row's ArgMax, as :func:`with_next_decode` computes it (over the logits clipped to
    +-FLOAT32_MAX: a row of -inf gives 0), and nothing else. Its nodes (Cast, Clip, ArgMax) have kernels in ONNX
    Runtime's CUDA EP, so on a GPU a greedy step's tokens cross the bus instead of its logits. ``ValueError`` when the
    graph has no logits or already has a value of the new names."""
    if OUTPUT_NAME not in {value.name for value in model.graph.output}:
        raise ValueError(f"not an exported decoder: it has no {OUTPUT_NAME!r}")
    _check_free(model.graph, [GREEDY_TOKENS] + [NEXT_PREFIX + name for name in
                                                ("logits_f32", "lowest", "highest", "logits_clipped")])
    return _extended(model, _greedy_nodes(model.graph, clipped=True),
                     [helper.make_tensor_value_info(GREEDY_TOKENS, TensorProto.INT64, None)])


def with_next_decode(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the exported decoder ``model`` with one more output per :data:`NEXT_DECODE_INPUTS` (named
    ``next_<input>``, int64, the input's shape): ``next_input_ids`` is each row's ArgMax of the logits (the first
    of equal maxima, as numpy's ``argmax``; float16/bfloat16 logits widened to float32 first, which keeps their
    order), the others are the following decode step's index inputs. The logits and the graph are unchanged.
    ``ValueError`` when the graph lacks an input this needs or already has a value of one of the new names."""
    graph = model.graph
    inputs = {value.name: value for value in graph.input}
    missing = [name for name in NEXT_DECODE_INPUTS if name not in inputs]
    if missing or OUTPUT_NAME not in {value.name for value in graph.output}:
        raise ValueError(f"not an exported decoder: it has no {', '.join(missing) or OUTPUT_NAME!r}")
    prefix = NEXT_PREFIX
    _check_free(graph, [prefix + name for name in NEXT_DECODE_INPUTS] + [f"{prefix}{part}" for part in
                                                                        ("one", "zero", "rows", "ramp", "logits_f32")])
    scalar = lambda name, value: helper.make_node(  # noqa: E731
        "Constant", [], [prefix + name], value=helper.make_tensor(prefix + name, TensorProto.INT64, [], [value]))
    one = prefix + "one"
    nodes = _greedy_nodes(graph) + [
        scalar("one", 1), scalar("zero", 0),
        helper.make_node("Add", ["positions", one], [prefix + "positions"]),
        helper.make_node("Add", ["start_pos", one], [prefix + "start_pos"]),
        helper.make_node("Add", ["max_kvlen", one], [prefix + "max_kvlen"]),
        # kvstarts[b] + b: every earlier sequence holds one key more
        helper.make_node("Size", ["kvstarts"], [prefix + "rows"]),
        helper.make_node("Range", [prefix + "zero", prefix + "rows", one], [prefix + "ramp"]),
        helper.make_node("Add", ["kvstarts", prefix + "ramp"], [prefix + "kvstarts"]),
    ]
    outputs = []
    for name in NEXT_DECODE_INPUTS:
        output = helper.make_tensor_value_info(prefix + name, TensorProto.INT64, None)
        # the input's shape as declared (named, fixed or anonymous dims alike); the tokens' is the logits' rows
        if name != "input_ids" and inputs[name].type.tensor_type.HasField("shape"):
            output.type.tensor_type.shape.CopyFrom(inputs[name].type.tensor_type.shape)
        outputs.append(output)
    return _extended(model, nodes, outputs)
