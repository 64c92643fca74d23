"""Models with an ``If`` or ``Loop`` node whose bodies hold the ops: ONNX Runtime hands a body the caller's buffers,
so the graph rules must see inside it."""

import copy

from onnx import TensorProto, helper

from kvcache_op import spec
from kvcache_op.validation.cases import Seq, build


def two_layer_case():
    """Two sequences storing into a two-layer float32 cache."""
    return build("order", [Seq(0, 3), Seq(4, 1)], num_layer=2, heads=2, head_dim=8, t1="float32")


def store_node(template, name, layer_idx, current_key="current_key"):
    """A copy of the KeyValueCache node ``template``, named ``name``, writing layer ``layer_idx``, its outputs
    ``{name}_key`` and ``{name}_value``."""
    node = copy.deepcopy(template)
    node.name, node.input[0] = name, current_key
    del node.output[:]
    node.output.extend([f"{name}_key", f"{name}_value"])
    for attribute in node.attribute:
        if attribute.name == "layer_idx":
            attribute.i = layer_idx
    return node


def branch(name, nodes, outputs):
    """An If branch holding ``nodes`` (reading the graph around it by name), giving ``outputs`` as float tensors."""
    ends = [helper.make_node("Identity", [output], [f"{name}_{k}"]) for k, output in enumerate(outputs)]
    return helper.make_graph([*nodes, *ends], name, [], [
        helper.make_tensor_value_info(f"{name}_{k}", TensorProto.FLOAT, None) for k in range(len(outputs))])


def with_if(model, name, then_nodes, then_outputs, else_nodes, else_outputs):
    """``model`` plus an If node on a new boolean input ``cond`` giving ``{name}_0``, ``{name}_1``, ... as outputs."""
    outputs = [f"{name}_{k}" for k in range(len(then_outputs))]
    model.graph.node.append(helper.make_node("If", ["cond"], outputs, name=name,
                                             then_branch=branch(f"{name}_then", then_nodes, then_outputs),
                                             else_branch=branch(f"{name}_else", else_nodes, else_outputs)))
    if not any(value.name == "cond" for value in model.graph.input):
        model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    model.graph.output.extend(helper.make_tensor_value_info(output, TensorProto.FLOAT, None) for output in outputs)
    return model


def without_nodes():
    """The two-layer case, its model with no node and no output, and the KeyValueCache node it had."""
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    template = copy.deepcopy(model.graph.node[0])
    del model.graph.node[:], model.graph.output[:]
    return case, model, template


def branch_stores(then_layer, else_layer):
    """The two-layer case and a model holding one If node, ``choose``, whose branches each store the case's tokens,
    into layer ``then_layer`` and ``else_layer`` of the cache."""
    case, model, template = without_nodes()
    then_store, else_store = store_node(template, "choose_a", then_layer), store_node(template, "choose_b", else_layer)
    return case, with_if(model, "choose", [then_store], list(then_store.output), [else_store], list(else_store.output))


def with_loop(model, name, nodes, carried=None, iteration="iteration"):
    """``model`` plus a Loop node ``name`` run once, its body holding ``nodes``. ``carried``: (the outer value passed
    as the loop-carried value, the body's name for it), or None; ``iteration``: the body's name for its iteration
    number. The Loop gives the carried value's final state (if any) and the iteration numbers."""
    inputs = [helper.make_tensor_value_info(iteration, TensorProto.INT64, []),
              helper.make_tensor_value_info(f"{name}_cond_in", TensorProto.BOOL, [])]
    ends = [helper.make_node("Identity", [f"{name}_cond_in"], [f"{name}_cond_out"])]
    finals, loop_inputs = [], [f"{name}_trip", ""]
    if carried:
        outer, inner = carried
        inputs.append(helper.make_tensor_value_info(inner, TensorProto.FLOAT, None))
        ends.append(helper.make_node("Identity", [inner], [f"{name}_carried_out"]))
        finals, loop_inputs = [f"{name}_final"], [*loop_inputs, outer]
    ends.append(helper.make_node("Identity", [iteration], [f"{name}_it"]))
    outputs = [helper.make_tensor_value_info(f"{name}_cond_out", TensorProto.BOOL, [])]
    outputs += [helper.make_tensor_value_info(f"{name}_carried_out", TensorProto.FLOAT, None)] * bool(carried)
    outputs.append(helper.make_tensor_value_info(f"{name}_it", TensorProto.INT64, []))
    body = helper.make_graph([*nodes, *ends], f"{name}_body", inputs, outputs)
    model.graph.initializer.append(helper.make_tensor(f"{name}_trip", TensorProto.INT64, [], [1]))
    model.graph.node.append(helper.make_node("Loop", loop_inputs, [*finals, f"{name}_its"], name=name, body=body))
    model.graph.output.extend(helper.make_tensor_value_info(output, TensorProto.FLOAT if output in finals else
                                                            TensorProto.INT64, None) for output in [*finals, f"{name}_its"])
    return model
