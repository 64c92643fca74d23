"""ONNX orders nodes only by data: a model whose in-place writes (or a read of a written cache) could run
in either order is refused, and models whose writes are independent or ordered by data are accepted."""

import copy

import numpy as np
import pytest
from onnx import helper

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, run_model
from kvcache_op.ort_ops.graph_rules import in_place_inputs
from kvcache_op.validation.outcome import reference_outcome
from control_flow_models import branch_stores, store_node, two_layer_case, with_if, with_loop, without_nodes


def with_second_node(layer_idx, current_key="current_key", outputs=("key2", "value2")):
    """The case's single-node model plus a second KeyValueCache node on the same cache."""
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    second = copy.deepcopy(model.graph.node[0])
    second.name, second.input[0] = "second", current_key
    del second.output[:]
    second.output.extend(outputs)
    for attribute in second.attribute:
        if attribute.name == "layer_idx":
            attribute.i = layer_idx
    model.graph.node.append(second)
    return case, model


def test_nodes_writing_different_layers_are_independent_and_accepted():
    case, model = with_second_node(layer_idx=1)
    assert in_place_inputs(model) == {"cache"}
    make_session(model)


def test_two_unordered_writes_of_one_layer_are_refused():
    _, model = with_second_node(layer_idx=0)
    with pytest.raises(ValueError, match="both write layer 0 of 'cache' and no data path orders them"):
        in_place_inputs(model)
    with pytest.raises(ValueError, match="no data path orders them"):
        make_session(model)


def test_two_unordered_writes_whose_outputs_are_read_are_refused():
    """Each write's outputs feed other nodes, none of which leads to the other write: still unordered."""
    _, model = with_second_node(layer_idx=0)
    for k, output in enumerate([*model.graph.node[0].output, "key2", "value2"]):
        model.graph.node.append(helper.make_node("Identity", [output], [f"read{k}"]))
    with pytest.raises(ValueError, match="both write layer 0 of 'cache' and no data path orders them"):
        in_place_inputs(model)


def test_a_data_path_orders_two_writes_of_one_layer():
    """The second node's key input is computed from the first node's output: it must run after."""
    case, model = with_second_node(layer_idx=0, current_key="ordered_key")
    first_key = model.graph.node[0].output[0]
    model.graph.node.insert(1, helper.make_node("Slice", [first_key, "zero", "tokens"], ["ordered_key"]))
    model.graph.initializer.extend([
        helper.make_tensor("zero", 7, [1], [0]),
        helper.make_tensor("tokens", 7, [1], [case.inputs["current_key"].shape[0]])])
    assert in_place_inputs(model) == {"cache"}
    feeds = {k: np.array(v, copy=True) for k, v in case.inputs.items() if v is not None}
    run_model(model, feeds)  # accepted and runs


def test_a_rotary_shift_and_a_store_of_the_same_layer_are_refused():
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    model.graph.node.append(helper.make_node("KeyCacheRotaryShift", ["cache", "", "slots", "cos", "sin"], ["slots_out"],
                                             domain=spec.schema.DOMAIN, num_layer=2, layer_idx=0))
    with pytest.raises(ValueError, match="KeyCacheRotaryShift node .* both write layer 0 of 'cache'"):
        in_place_inputs(model)


@pytest.mark.parametrize("op_type,refused", [("Identity", True), ("ReduceMax", True), ("Shape", False), ("Size", False)])
def test_other_nodes_may_read_only_the_caches_shape(op_type, refused):
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    model.graph.node.append(helper.make_node(op_type, ["cache"], [f"{op_type}_out"]))
    if refused:
        with pytest.raises(ValueError, match=f"{op_type} node .* reads 'cache'"):
            in_place_inputs(model)
    else:
        assert in_place_inputs(model) == {"cache"}


def fused_with_second_writer(op_type: str, layer_idx: int):
    """A two-layer MultiHeadCacheAttention model (layer 1) plus a second node writing layer ``layer_idx`` of the same
    cache with no data path between them: another MultiHeadCacheAttention, or a KeyValueCache."""
    from kvcache_op.benchmarks.attention.fused import Shape, make_call

    inputs, attributes = make_call(Shape(2, 1, 8, 4, 2, head_dim=16))
    inputs["cache"] = np.concatenate([inputs["cache"]] * 2, axis=1)  # layout 0: (slots, layers, 2, kv heads, dim)
    model = spec.make_cache_attention_model(inputs, **dict(attributes, num_layer=2, layer_idx=1))
    fused = model.graph.node[0]
    if op_type == "MultiHeadCacheAttention":
        second = copy.deepcopy(fused)
        second.name = "second"
        del second.output[:]
        second.output.append("output2")
    else:
        second = helper.make_node("KeyValueCache", [*(fused.input[i] for i in (1, 2, 3, 4, 5, 6, 8, 9)), "cache", ""],
                                  ["key2", "value2"],
                                  name="second", domain=spec.schema.DOMAIN, num_layer=2, num_heads=2, head_dim=16,
                                  cache_mode=1, page_size=128)
    for attribute in second.attribute:
        if attribute.name == "layer_idx":
            attribute.i = layer_idx
    if not any(a.name == "layer_idx" for a in second.attribute):
        second.attribute.append(helper.make_attribute("layer_idx", layer_idx))
    model.graph.node.append(second)
    return model


@pytest.mark.parametrize("op_type", ["MultiHeadCacheAttention", "KeyValueCache"])
def test_the_fused_op_is_a_writer_of_its_layer(op_type):
    """The fused op writes its layer like KeyValueCache: beside a writer of another layer it is accepted (one node per
    layer), beside an unordered writer of its own layer refused."""
    assert in_place_inputs(fused_with_second_writer(op_type, layer_idx=0)) == {"cache"}
    with pytest.raises(ValueError, match="both write layer 1 of 'cache' and no data path orders them"):
        in_place_inputs(fused_with_second_writer(op_type, layer_idx=1))


@pytest.mark.parametrize("cond, layer_idx", [(True, 0), (False, 1)])
def test_a_store_inside_an_if_branch_lands_in_the_callers_cache(cond, layer_idx):
    """ONNX Runtime hands a branch the caller's buffers: the branch taken stores into the caller's cache, as the
    reference does on that layer, so the rule must see writes inside bodies."""
    case, model = branch_stores(then_layer=0, else_layer=1)
    assert in_place_inputs(model) == {"cache"}
    feeds = {k: np.array(v, copy=True) for k, v in case.inputs.items() if v is not None}
    key, value = run_model(model, dict(feeds, cond=np.array(cond)))
    expected = reference_outcome("KeyValueCache", case.inputs, dict(case.attributes, num_layer=2, layer_idx=layer_idx))
    np.testing.assert_array_equal(feeds["cache"], expected.after["cache"])
    np.testing.assert_array_equal(key, expected.outputs["key"])
    np.testing.assert_array_equal(value, expected.outputs["value"])


def test_a_read_beside_an_if_that_writes_the_cache_is_refused():
    case, model = branch_stores(then_layer=0, else_layer=1)
    model.graph.node.append(helper.make_node("Identity", ["cache"], ["cache_seen"], name="peek"))
    with pytest.raises(ValueError, match=r"Identity node peek reads 'cache', which If node choose \(layer_idx 0, 1 "
                                         r"inside it\) writes in place"):
        in_place_inputs(model)


def test_a_read_inside_an_if_beside_a_writer_is_refused():
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    peek = [helper.make_node("ReduceMax", ["cache"], ["cache_max"])]
    model = with_if(model, "look", peek, ["cache_max"], [helper.make_node("Identity", ["current_key"], ["k"])], ["k"])
    with pytest.raises(ValueError, match=r"If node look reads 'cache' inside it, which KeyValueCache node .* writes"):
        in_place_inputs(model)


@pytest.mark.parametrize("layers, refused", [((0, 0), True), ((0, 1), False), ((1, 1), True)])
def test_two_ifs_writing_one_layer_with_no_order_between_them_are_refused(layers, refused):
    """Two If nodes each storing in one branch: refused where the layers they may write meet, as two plain stores."""
    _, model, template = without_nodes()
    for name, layer in zip(("first", "second"), layers):
        store = store_node(template, f"{name}_store", layer)
        keep = helper.make_node("Identity", ["current_key"], [f"{name}_k"])
        model = with_if(model, name, [store], [store.output[0]], [keep], [f"{name}_k"])
    if refused:
        with pytest.raises(ValueError, match=f"If node first .* and If node second .* both write layer {layers[0]} "
                                             "of 'cache' and no data path orders them"):
            in_place_inputs(model)
    else:
        assert in_place_inputs(model) == {"cache"}


def test_a_read_and_a_write_inside_one_branch_are_refused():
    """Each body is held to the rule among its own nodes."""
    _, model, template = without_nodes()
    store = store_node(template, "inner", 0)
    peek = helper.make_node("Identity", ["cache"], ["cache_seen"], name="inner_peek")
    model = with_if(model, "choose", [store, peek], [store.output[0], "cache_seen"],
                    [helper.make_node("Identity", ["current_key"], [f"k{k}"]) for k in range(2)], ["k0", "k1"])
    with pytest.raises(ValueError, match="Identity node inner_peek reads 'cache', which KeyValueCache node inner"):
        in_place_inputs(model)


def test_an_outer_value_used_inside_a_branch_orders_the_branch_after_its_producer():
    """The branch's store reads the first store's key (an outer value, not an input of the If node): the If node
    runs after the first store, so the two writes of layer 0 are ordered, and accepted."""
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    first_key = model.graph.node[0].output[0]
    tokens = case.inputs["current_key"].shape[0]
    model.graph.initializer.extend([helper.make_tensor("zero", 7, [1], [0]), helper.make_tensor("tokens", 7, [1], [tokens])])
    ordered = helper.make_node("Slice", [first_key, "zero", "tokens"], ["ordered_key"])
    store = store_node(model.graph.node[0], "later", 0, current_key="ordered_key")
    model = with_if(model, "then_store", [ordered, store], [store.output[0]],
                    [helper.make_node("Identity", ["current_key"], ["k"])], ["k"])
    assert in_place_inputs(model) == {"cache"}


def test_an_empty_optional_name_is_no_data_path():
    """An output left empty (Dropout's mask) and an input left empty (the second store's scale) are no value: they do
    not order the second store after the first."""
    _, model, template = without_nodes()
    first, second = store_node(template, "first", 0), store_node(template, "second", 0)
    del second.input[9:]
    second.input.append("")
    dropout = helper.make_node("Dropout", ["first_key"], ["dropped", ""], name="drop")
    model.graph.node.extend([first, dropout, second])
    with pytest.raises(ValueError, match="node first .* and KeyValueCache node second .* both write layer 0"):
        in_place_inputs(model)


def test_writers_of_one_cache_in_different_layouts_are_refused():
    """In two layouts the layers of one cache overlap (layer 1 of layout 1 holds slots of layer 0 of layout 0), so
    writing different layers is no longer independent."""
    _, model = with_second_node(layer_idx=1)
    next(a for a in model.graph.node[1].attribute if a.name == "cache_layout").i = 1
    with pytest.raises(ValueError, match=r"write 'cache' in different layouts \(cache_layout 0 and 1\)"):
        in_place_inputs(model)


def test_a_loop_passing_the_cache_its_body_writes_as_its_carried_value_is_refused():
    """The body gets the caller's cache buffer as its carried value: its reads of that value are unordered against
    the store inside it."""
    _, model, template = without_nodes()
    model = with_loop(model, "again", [store_node(template, "inner", 0)], carried=("cache", "carried"))
    with pytest.raises(ValueError, match="Loop node again passes 'cache' into its body as an input, and a node "
                                         "inside writes it in place"):
        in_place_inputs(model)


def test_a_body_input_named_as_an_outer_value_is_the_bodys_own():
    """The Loop body names its iteration number like the first store's key: that is the body's value, so nothing
    orders the Loop's store after the first store."""
    _, model, template = without_nodes()
    model.graph.node.append(store_node(template, "first", 0))
    model = with_loop(model, "again", [store_node(template, "inner", 0)], iteration="first_key")
    with pytest.raises(ValueError, match="node first .* and Loop node again .* both write layer 0 of 'cache' and no "
                                         "data path orders them"):
        in_place_inputs(model)


def test_a_store_into_a_body_value_named_as_the_graph_input_is_refused():
    """The Loop body's carried value is named ``cache``, like the graph input: a store inside writes the body's
    value (a copy of what the Loop was given), never the caller's cache."""
    _, model, template = without_nodes()
    model = with_loop(model, "again", [store_node(template, "inner", 0)], carried=("current_key", "cache"))
    with pytest.raises(ValueError, match="KeyValueCache node inner: cache 'cache' is a value of the subgraph around "
                                         "it"):
        in_place_inputs(model)


def test_shape_in_the_default_domains_other_name_reads_no_data():
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    model.graph.node.append(helper.make_node("Shape", ["cache"], ["cache_shape"], domain="ai.onnx"))
    assert in_place_inputs(model) == {"cache"}
