"""The cache is written in place, so the session helpers refuse what cannot take the writes: read-only
arrays, and caches that do not come straight from a graph input (constants behind Identity/Reshape,
initializers that double as graph inputs, computed tensors)."""

import numpy as np
import onnx
import pytest
from onnx import helper

from kvcache_op import spec
from kvcache_op.ort_ops import make_session, ortvalue_for, run_model
from kvcache_op.ort_ops.graph_rules import in_place_inputs
from kvcache_op.validation.cases import CASES
from kvcache_op.validation.outcome import reference_outcome
from processes import run_script
from control_flow_models import branch_stores, store_node, two_layer_case, with_if, without_nodes


def kv_case(name="offset_layout0"):
    case = CASES[name]()
    return case, spec.make_model(case.inputs, **case.attributes)


def feeds_of(case):
    return {k: v.copy() for k, v in case.inputs.items() if v is not None}


def test_a_read_only_cache_is_refused_and_stays_intact():
    case, model = kv_case()
    feeds = feeds_of(case)
    frozen = bytes(feeds["cache"].tobytes())
    feeds["cache"] = np.frombuffer(frozen, feeds["cache"].dtype).reshape(feeds["cache"].shape)
    with pytest.raises(ValueError, match="read-only"):
        run_model(model, feeds)
    assert frozen == case.inputs["cache"].tobytes()
    with pytest.raises(ValueError, match="read-only"):
        ortvalue_for(feeds["cache"])


def test_a_read_only_int4_cache_is_refused_before_the_run_and_stays_intact():
    """An int4 cache runs on a packed copy whose writes are copied back: a read-only one is refused before the run
    (not after it, by numpy, with the outputs lost)."""
    case, model = kv_case("int4_layout0")
    feeds = feeds_of(case)
    frozen = feeds["cache"].copy()
    feeds["cache"].flags.writeable = False
    with pytest.raises(ValueError, match="this array is read-only"):
        run_model(model, feeds)
    assert feeds["cache"].view(np.uint8).tobytes() == frozen.view(np.uint8).tobytes()


def test_a_read_only_memmap_cache_is_a_clear_error_not_a_crash(tmp_path):
    """np.memmap(mode="r") maps the file read-only: a write through it is a SIGSEGV. Run in a child so
    a crash fails this test instead of the whole session."""
    script = f"""
        import numpy as np
        from kvcache_op import spec
        from kvcache_op.ort_ops import run_model
        from kvcache_op.validation.cases import CASES
        case = CASES["offset_layout0"]()
        feeds = {{k: v.copy() for k, v in case.inputs.items() if v is not None}}
        path = {str(tmp_path / "cache.bin")!r}
        feeds["cache"].tofile(path)
        feeds["cache"] = np.memmap(path, feeds["cache"].dtype, mode="r", shape=feeds["cache"].shape)
        try:
            run_model(spec.make_model(case.inputs, **case.attributes), feeds)
        except ValueError as error:
            assert "read-only" in str(error), error
            print("refused")
    """
    child = run_script(script)
    assert child.returncode == 0 and "refused" in child.stdout, (child.returncode, child.stderr[-2000:])


def test_read_only_inputs_that_are_only_read_are_fine():
    case, model = kv_case()
    feeds = feeds_of(case)
    for name in ("current_key", "seqstarts"):
        feeds[name] = feeds[name].copy()
        feeds[name].flags.writeable = False
    key, _ = run_model(model, feeds)
    assert key.shape[0] == case.inputs["kvstarts"][-1]


def with_cache_behind(model, op_type, extra_inputs=()):
    """``model`` with its ``cache`` graph input replaced by an initializer reached through ``op_type``."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    cache_info = next(v for v in graph.input if v.name == "cache")
    cache = np.zeros([d.dim_value for d in cache_info.type.tensor_type.shape.dim],
                     onnx.helper.tensor_dtype_to_np_dtype(cache_info.type.tensor_type.elem_type))
    graph.input.remove(cache_info)
    graph.initializer.append(onnx.numpy_helper.from_array(cache, "cache_const"))
    for name, value in extra_inputs:
        graph.initializer.append(onnx.numpy_helper.from_array(value, name))
    graph.node.insert(0, helper.make_node(op_type, ["cache_const", *[n for n, _ in extra_inputs]], ["cache"]))
    return model


@pytest.mark.parametrize("op_type", ["Identity", "Reshape"])
def test_a_constant_cache_behind_a_node_is_refused(op_type):
    case, model = kv_case()
    extra = [("shape", np.array(case.inputs["cache"].shape, np.int64))] if op_type == "Reshape" else []
    bad = with_cache_behind(model, op_type, extra)
    with pytest.raises(ValueError, match="computed by another node"):
        make_session(bad)
    with pytest.raises(ValueError, match="computed by another node"):
        run_model(bad, {k: v for k, v in feeds_of(case).items() if k != "cache"})


def test_an_initializer_that_is_also_a_graph_input_is_refused():
    case, model = kv_case()
    model.graph.initializer.append(onnx.numpy_helper.from_array(case.inputs["cache"], "cache"))
    with pytest.raises(ValueError, match="is an initializer"):
        make_session(model)


def test_the_rotary_shift_cache_follows_the_same_rule():
    cache = np.zeros((8, 1, 2, 1, 4), np.float32)
    inputs = dict(cache=cache, scale=None, slots=np.array([1, 2]), cos=np.ones((2, 2), np.float32),
                  sin=np.zeros((2, 2), np.float32))
    model = spec.make_rotary_shift_model(inputs)
    assert in_place_inputs(model) == {"cache"}
    bad = with_cache_behind(model, "Identity")
    with pytest.raises(ValueError, match="KeyCacheRotaryShift node .* computed by another node"):
        in_place_inputs(bad)


def test_in_place_inputs_of_a_model_from_a_path(tmp_path):
    case, model = kv_case("int8_layout1")
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    assert in_place_inputs(str(path)) == {"cache", "scale"}
    assert in_place_inputs(model.SerializeToString()) == {"cache", "scale"}


def mhca_case():
    """A small valid MultiHeadCacheAttention call (decode, paged int8 cache) and its model."""
    from kvcache_op.benchmarks.attention.fused import Shape, make_call

    inputs, attributes = make_call(Shape(2, 1, 8, 4, 2, head_dim=16, dtype="float16", quant_bit=8))
    return inputs, spec.make_cache_attention_model(inputs, **attributes)


def test_the_fused_ops_cache_and_scale_follow_the_same_rule():
    """MultiHeadCacheAttention stores this step's keys into its cache and scale in place, as KeyValueCache does: a
    cache it cannot write through is refused, not copied (its stores would be lost), and so is one behind a node."""
    inputs, model = mhca_case()
    assert in_place_inputs(model) == {"cache", "scale"}
    feeds = {k: v.copy() for k, v in inputs.items() if v is not None}
    frozen = feeds["cache"].copy()
    feeds["cache"].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        run_model(model, feeds)
    feeds["cache"] = np.asfortranarray(frozen)
    with pytest.raises(ValueError, match="C-contiguous"):
        run_model(model, feeds)
    assert np.array_equal(feeds["cache"], frozen)
    with pytest.raises(ValueError, match="MultiHeadCacheAttention node .* computed by another node"):
        make_session(with_cache_behind(model, "Identity"))
    model.graph.initializer.append(onnx.numpy_helper.from_array(inputs["cache"], "cache"))
    with pytest.raises(ValueError, match="is an initializer"):
        make_session(model)


def in_a_function(model, calls=1, imports=None):
    """``model`` (one op node) with that node moved into a model-local function the graph calls ``calls`` times
    (each call's outputs renamed after the first): ONNX Runtime inlines such functions when it loads the model.
    ``imports``: the function's opset imports (default the model's)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    (node,) = model.graph.node
    inputs = [name for name in node.input if name]
    body = onnx.NodeProto.FromString(node.SerializeToString())
    model.functions.append(helper.make_function("local", "store", inputs, list(node.output), [body],
                                                list(model.opset_import) if imports is None else imports))
    model.graph.ClearField("node")
    for call in range(calls):
        outputs = [o if call == 0 else f"{o}_{call}" for o in node.output]
        model.graph.node.append(helper.make_node("store", inputs, outputs, domain="local", name=f"call{call}"))
        if call:
            model.graph.output.extend(helper.make_value_info(o, onnx.TypeProto()) for o in outputs)
    model.opset_import.append(helper.make_opsetid("local", 1))
    return model


def test_a_cache_written_inside_a_model_local_function_follows_the_rule_where_the_function_is_called():
    """The rule looks through the call: a graph input passed as the cache is written in place, as without the
    function; a read-only array fed to it is refused, not run on a copy whose writes are lost; an initializer passed
    as the cache is refused, as it is at the top level (the writes would land in a constant)."""
    case, model = kv_case()
    wrapped = in_a_function(model)
    assert in_place_inputs(wrapped) == {"cache"}
    feeds, plain = feeds_of(case), feeds_of(case)
    assert all(np.array_equal(a, b) for a, b in zip(run_model(wrapped, feeds), run_model(model, plain)))
    assert np.array_equal(feeds["cache"], plain["cache"]) and not np.array_equal(feeds["cache"], case.inputs["cache"])
    frozen = bytes(case.inputs["cache"].tobytes())  # read-only: refused, not copied (the writes would be lost)
    feeds["cache"] = np.frombuffer(frozen, feeds["cache"].dtype).reshape(feeds["cache"].shape)
    with pytest.raises(ValueError, match="read-only"):
        run_model(wrapped, feeds)
    graph = wrapped.graph
    graph.input.remove(next(v for v in graph.input if v.name == "cache"))
    graph.initializer.append(onnx.numpy_helper.from_array(case.inputs["cache"], "cache"))
    with pytest.raises(ValueError, match="KeyValueCache node .* is an initializer"):
        make_session(wrapped)


def test_two_calls_writing_one_layer_with_no_order_between_them_are_refused():
    case, model = kv_case()
    with pytest.raises(ValueError, match="both write layer 0 of 'cache' and no data path orders them"):
        in_place_inputs(in_a_function(model, calls=2))


def test_an_unknown_attribute_inside_a_model_local_function_is_refused():
    from kvcache_op.ort_ops.graph_rules import check_attribute_names

    case, model = kv_case()
    model.graph.node[0].attribute.append(helper.make_attribute("pagesize", 8))
    with pytest.raises(ValueError, match=r"KeyValueCache node .*unknown attribute\(s\) \['pagesize'\]"):
        check_attribute_names(in_a_function(model))


def test_a_function_of_another_standard_opset_is_inlined_and_checked():
    """A function importing ai.onnx at another version than the model is inlined with its opset converted, as ONNX
    Runtime takes it: a read-only cache written inside it is refused (left uninlined, it ran on a copy whose writes
    were lost)."""
    case, model = kv_case()
    wrapped = in_a_function(model, imports=[helper.make_opsetid(spec.DOMAIN, 1), helper.make_opsetid("", 13)])
    assert in_place_inputs(wrapped) == {"cache"}
    feeds = feeds_of(case)
    feeds["cache"] = np.frombuffer(case.inputs["cache"].tobytes(), feeds["cache"].dtype).reshape(feeds["cache"].shape)
    with pytest.raises(ValueError, match="read-only"):
        run_model(wrapped, feeds)


def test_a_domain_only_the_function_imports_is_imported_for_the_checks():
    """ONNX Runtime runs a model whose function alone imports the op's domain; the checks take the import from the
    function, and the writes land in the caller's cache."""
    case, model = kv_case()
    wrapped = in_a_function(model, imports=[helper.make_opsetid(spec.DOMAIN, 1)])
    kept = [entry for entry in wrapped.opset_import if entry.domain != spec.DOMAIN]
    wrapped.ClearField("opset_import")
    wrapped.opset_import.extend(kept)
    feeds, plain = feeds_of(case), feeds_of(case)
    run_model(wrapped, feeds)
    run_model(model, plain)
    assert np.array_equal(feeds["cache"], plain["cache"]) and not np.array_equal(feeds["cache"], case.inputs["cache"])


def test_a_function_the_inliner_cannot_take_is_refused_only_where_it_reaches_the_ops(monkeypatch):
    from kvcache_op.ort_ops import graph_rules

    def fails(*args, **kwargs):
        raise RuntimeError("no conversion")

    case, model = kv_case()
    monkeypatch.setattr(graph_rules.onnx.inliner, "inline_local_functions", fails)
    with pytest.raises(ValueError, match=r"model-local function local::store reaches an op of this package, and "
                                         r"could not be inlined .*no conversion"):
        in_place_inputs(in_a_function(model))
    wrapped = in_a_function(model)  # the op one call further down: reached all the same
    (call,) = wrapped.graph.node
    wrapped.functions.append(helper.make_function("local", "outer", list(call.input), list(call.output),
                                                  [onnx.NodeProto.FromString(call.SerializeToString())],
                                                  [helper.make_opsetid("local", 1)]))
    call.op_type = "outer"
    with pytest.raises(ValueError, match=r"model-local function local::outer reaches an op of this package"):
        in_place_inputs(wrapped)
    plain = onnx.ModelProto.FromString(model.SerializeToString())  # a function of standard ops only: let be
    identity = helper.make_node("Identity", ["x"], ["y"])
    plain.functions.append(helper.make_function("local", "same", ["x"], ["y"], [identity], [helper.make_opsetid("", 21)]))
    assert in_place_inputs(plain) == {"cache"}


def test_functions_calling_each_other_in_a_cycle_are_followed_once(monkeypatch):
    """Where the inliner cannot take the functions, the check follows each call once: two functions calling each other
    (and reaching no op of the package) are let be, not followed without end."""
    from kvcache_op.ort_ops import graph_rules

    def fails(*args, **kwargs):
        raise RuntimeError("recursive")

    monkeypatch.setattr(graph_rules.onnx.inliner, "inline_local_functions", fails)
    case, model = kv_case()
    for name, callee in (("ping", "pong"), ("pong", "ping")):
        call = helper.make_node(callee, ["x"], ["y"], domain="local")
        model.functions.append(helper.make_function("local", name, ["x"], ["y"], [call],
                                                    [helper.make_opsetid("local", 1)]))
    model.graph.node.append(helper.make_node("ping", ["current_key"], ["pinged"], domain="local"))
    model.opset_import.append(helper.make_opsetid("local", 1))
    assert in_place_inputs(model) == {"cache"}


def with_attribute_from_default(model, name, default):
    """``model`` (one op node) with the node moved into a model-local function ``local::store`` whose attribute
    ``name`` comes from the function attribute ``given`` of default ``default``; the call sets none."""
    (node,) = model.graph.node
    body = onnx.NodeProto.FromString(node.SerializeToString())
    body.attribute.remove(next(a for a in body.attribute if a.name == name))
    body.attribute.append(onnx.AttributeProto(name=name, ref_attr_name="given", type=onnx.AttributeProto.INT))
    inputs = [n for n in node.input if n]
    function = helper.make_function("local", "store", inputs, list(node.output), [body], list(model.opset_import))
    function.attribute_proto.append(helper.make_attribute("given", default))
    model.functions.append(function)
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.graph.ClearField("node")
    model.graph.node.append(helper.make_node("store", inputs, list(node.output), domain="local", name="call"))
    return model


def test_an_attribute_from_a_functions_default_is_checked_as_onnx_runtime_runs_it():
    """ONNX Runtime gives a call the function's default attribute values; onnx's inliner drops an unset reference.
    Checked with the default: two unordered calls both on layer 1 (the default), and a quant_bit of 8 from the
    default, whose scale is then written and may not come from a node."""
    case = two_layer_case()
    model = with_attribute_from_default(spec.make_model(case.inputs, **dict(case.attributes, num_layer=2)),
                                        "layer_idx", 1)
    second = onnx.NodeProto.FromString(model.graph.node[0].SerializeToString())
    second.name, second.input[0] = "second_call", "other_key"
    del second.output[:]
    second.output.extend(["key2", "value2"])
    model.graph.node.extend([helper.make_node("Neg", ["current_key"], ["other_key"]), second])
    with pytest.raises(ValueError, match=r"\(layer_idx 1\) and KeyValueCache node \S+ \(layer_idx 1\) both write layer 1"):
        in_place_inputs(model)
    case, model = kv_case("int8_layout0")
    model = with_attribute_from_default(model, "quant_bit", 8)
    next(v for v in model.graph.input if v.name == "scale").name = "scale_in"
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros((), case.inputs["scale"].dtype), "zero"))
    model.graph.node.insert(0, helper.make_node("Add", ["scale_in", "zero"], ["scale"]))
    with pytest.raises(ValueError, match="scale 'scale' is computed by another node"):
        in_place_inputs(model)


def test_a_function_with_the_name_of_an_op_of_the_package_is_refused():
    """ONNX Runtime runs the op's kernel, not such a function: its body (here, two Identity nodes) says nothing of
    what runs, and taking it for the op would hide the op's writes from every check."""
    case, model = kv_case()
    (node,) = model.graph.node
    body = [helper.make_node("Identity", [node.input[i]], [output]) for i, output in enumerate(node.output)]
    model.functions.append(helper.make_function(spec.DOMAIN, "KeyValueCache", [n for n in node.input if n],
                                                list(node.output), body, [helper.make_opsetid("", 17)]))
    with pytest.raises(ValueError, match=r"function opmx\.dynamic_batching::KeyValueCache has the name of an op of "
                                         r"this package"):
        make_session(model)


def test_sparse_initializers_are_initializers():
    """A model holding a sparse initializer is checked (its name is its values'), and a cache fed by one refused."""
    case, model = kv_case()
    values = helper.make_tensor("unused", onnx.TensorProto.FLOAT, [1], [1.0])
    indices = helper.make_tensor("unused_indices", onnx.TensorProto.INT64, [1], [0])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    assert in_place_inputs(model) == {"cache"}
    values = helper.make_tensor("cache", onnx.TensorProto.FLOAT, [1], [1.0])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, list(case.inputs["cache"].shape)))
    with pytest.raises(ValueError, match="cache 'cache' is an initializer"):
        in_place_inputs(model)


def test_two_written_inputs_sharing_memory_are_refused_and_left_intact():
    """Two caches, each written by its own node: one array fed to both would take both writes, unordered."""
    case = two_layer_case()
    model = spec.make_model(case.inputs, **dict(case.attributes, num_layer=2))
    second = onnx.NodeProto.FromString(model.graph.node[0].SerializeToString())
    second.input[8], second.name = "cache2", "second"
    del second.output[:]
    second.output.extend(["key2", "value2"])
    model.graph.node.append(second)
    model.graph.input.append(onnx.ValueInfoProto.FromString(
        next(v for v in model.graph.input if v.name == "cache").SerializeToString()))
    model.graph.input[-1].name = "cache2"
    feeds = feeds_of(case)
    feeds["cache2"] = feeds["cache"][:]  # a view of the same memory
    with pytest.raises(ValueError, match="inputs 'cache' and 'cache2' share memory"):
        run_model(model, feeds)
    assert np.array_equal(feeds["cache"], case.inputs["cache"])
    feeds["cache2"] = feeds["cache"].copy()
    run_model(model, feeds)
    expected = reference_outcome("KeyValueCache", case.inputs, dict(case.attributes, num_layer=2)).after["cache"]
    assert np.array_equal(feeds["cache"], expected) and np.array_equal(feeds["cache2"], expected)


def copy_of(name):
    """An Identity node giving ``name`` from the step's current_key (a branch that stores nothing)."""
    return helper.make_node("Identity", ["current_key"], [name])


def test_a_cache_written_inside_an_if_branch_follows_the_rule():
    """A store inside a branch writes the caller's buffer as one outside does: its cache must be a graph input of the
    model, not an initializer (the writes would land in a constant) nor a value computed inside the branch."""
    from kvcache_op.ort_ops.graph_rules import check_attribute_names

    case, model = branch_stores(then_layer=0, else_layer=1)
    assert in_place_inputs(model) == {"cache"}
    constant = onnx.ModelProto.FromString(model.SerializeToString())
    constant.graph.input.remove(next(v for v in constant.graph.input if v.name == "cache"))
    constant.graph.initializer.append(onnx.numpy_helper.from_array(case.inputs["cache"], "cache"))
    with pytest.raises(ValueError, match="KeyValueCache node choose_[ab]: cache 'cache' is an initializer"):
        make_session(constant)
    _, computed, template = without_nodes()
    copied = helper.make_node("Identity", ["cache"], ["cache_copy"])
    store = store_node(template, "inner", 0)
    store.input[8] = "cache_copy"
    computed = with_if(computed, "choose", [copied, store], list(store.output), [copy_of("k0"), copy_of("k1")],
                       ["k0", "k1"])
    with pytest.raises(ValueError, match="KeyValueCache node inner: cache 'cache_copy' is computed by another node"):
        in_place_inputs(computed)
    misspelt = onnx.ModelProto.FromString(model.SerializeToString())
    misspelt.graph.node[0].attribute[0].g.node[0].attribute.append(helper.make_attribute("pagesize", 8))
    with pytest.raises(ValueError, match=r"KeyValueCache node choose_[ab]: unknown attribute\(s\) \['pagesize'\]"):
        check_attribute_names(misspelt)


def test_a_node_of_the_ops_domain_the_package_lacks_is_left_to_onnx_runtime():
    """The attribute check knows the package's ops only: a misspelt op type is ONNX Runtime's to report (it has no
    kernel of that name), not an error of the check."""
    from kvcache_op.ort_ops.graph_rules import check_attribute_names

    case, model = kv_case()
    model.graph.node[0].op_type = "KeyValueCach"
    check_attribute_names(model)
    with pytest.raises(Exception, match="KeyValueCach"):
        make_session(model)
