"""What a user without the op would run: one KeyValueCache step composed from ONNX Runtime's built-in ops,
with the slot indices computed on the host, as a cache manager would hand them over.

* Paged (cache_mode 1), layouts 0 ``(MaxT, L, 2, H, Dh)`` and 3 ``(L, 2, H, MaxT, Dh)``: one ScatterND stores
  this step's keys and values into the cache, Gather loads every sequence's slots. ScatterND's output
  ``cache_out`` is bound to the cache's own memory: ONNX Runtime's ScatterND copies its input into its output only
  where the two differ, so it then updates the cache in place, as the op does (bound to a buffer of its own, it
  would copy the whole cache every step, a cost a user binding it in place does not pay).
* Each output is one Gather straight from the cache read as rows (a Reshape, which copies nothing): the row of
  every loaded (slot, head) computed on the host with the slots, so no intermediate tensor is copied (picking
  the layer, then the key or value half, then the slots, would copy the cache's rows up to three times).
* Offset (cache_mode 0), layout 0 with one layer, every sequence owning ``MaxS`` consecutive slots from
  ``b * MaxS`` and storing the same number of tokens: the cache read as ``(B, MaxS, 1, 2, H, Dh)`` is what
  ONNX's ``TensorScatter`` (opset 24, its KV-cache update op) takes. TensorScatter writes this step's rows at
  ``start_pos``, then the same Gathers load. Its output ``cache_out`` is bound to the cache's own memory,
  which is how ONNX Runtime runs TensorScatter in place (no copy of the cache); where the installed ONNX
  Runtime has no TensorScatter, :func:`tensor_scatter_available` says so and there is no offset baseline.

Every op only copies, so the baselines reproduce the op's bits exactly (the tests check it).
"""

import functools

import numpy as np

from ...validation.call_slots import call_slots

LAYOUTS = (0, 3)
#: offset mode: layouts whose one-layer cache reads as TensorScatter's (B, MaxS, ...) batch-major tensor
OFFSET_LAYOUTS = (0,)
OPSET, TENSOR_SCATTER_OPSET = 21, 24


def gather_rows(cache_shape: tuple, layout: int, layer: int, slots: np.ndarray) -> dict:
    """``key_rows`` and ``value_rows``: where each loaded slot's rows lie in the cache read as rows, layout 0
    ``(MaxT * L * 2, H, Dh)`` (one index per slot) or layout 3 ``(L * 2 * H * MaxT, Dh)`` (one per slot and head),
    so that one Gather of them is the op's key or value output."""
    slots = np.asarray(slots, np.int64)
    if layout == 0:
        layers = cache_shape[1]
        return {name: (slots * layers + layer) * 2 + kv for kv, name in ((0, "key_rows"), (1, "value_rows"))}
    heads, capacity = cache_shape[2], cache_shape[3]
    h = np.arange(heads, dtype=np.int64)[None, :]
    return {name: ((layer * 2 + kv) * heads + h) * capacity + slots[:, None]
            for kv, name in ((0, "key_rows"), (1, "value_rows"))}


def baseline_feeds(inputs: dict, page_size: int, layout: int, layer: int = 0) -> dict:
    """The paged baseline graph's inputs: the data tensors and the scatter/gather indices for ``layout``."""
    store, gather = call_slots(inputs["seqstarts"], inputs["kvstarts"], inputs["cachestarts"], inputs["start_pos"],
                               cache_mode=1, page_size=page_size)
    tokens, heads = inputs["current_key"].shape[:2]
    feeds = {"current_key": inputs["current_key"], "current_value": inputs["current_value"], "cache": inputs["cache"],
             **gather_rows(inputs["cache"].shape, layout, layer, gather)}
    halves = []
    for kv in (0, 1):  # the keys' indices, then the values': one ScatterND stores both
        if layout == 0:  # one (slot, layer, kv) index per token, updating an (H, Dh) block
            halves.append(np.stack([store, np.full(tokens, layer), np.full(tokens, kv)], axis=1))
        else:  # one (layer, kv, h, slot) index per token and head, updating a Dh row
            h = np.broadcast_to(np.arange(heads), (tokens, heads))
            s = np.broadcast_to(store[:, None], (tokens, heads))
            halves.append(np.stack([np.full_like(s, layer), np.full_like(s, kv), h, s], axis=2))
    feeds["store_rows"] = np.concatenate(halves).astype(np.int64)
    return feeds


def _gather_outputs(cache: str, row_shape: list, layout: int) -> tuple:
    """The nodes that read ``cache`` as rows of ``row_shape`` and gather the key and value outputs from it, and
    the graph inputs of their row indices."""
    import onnx
    from onnx import helper

    index_shape = ["kv"] if layout == 0 else ["kv", "heads"]
    nodes = [helper.make_node("Reshape", [cache, "row_shape"], ["cache_rows"]),
             helper.make_node("Gather", ["cache_rows", "key_rows"], ["key"], axis=0),
             helper.make_node("Gather", ["cache_rows", "value_rows"], ["value"], axis=0)]
    inputs = [helper.make_tensor_value_info(n, onnx.TensorProto.INT64, index_shape) for n in ("key_rows", "value_rows")]
    return nodes, inputs, [onnx.numpy_helper.from_array(np.array(row_shape, np.int64), "row_shape")]


def _row_shape(cache_shape: tuple, layout: int) -> list:
    """The cache read as rows: ``(-1, H, Dh)`` in layout 0 (a slot, layer and half's heads), ``(-1, Dh)`` in 3."""
    return [-1, cache_shape[-2], cache_shape[-1]] if layout == 0 else [-1, cache_shape[-1]]


def _model(nodes, graph_inputs, inputs, cache_out_shape, initializers, opset):
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(inputs["current_key"].dtype)
    heads, head_dim = inputs["current_key"].shape[1:]
    outputs = [helper.make_tensor_value_info(n, elem, ["kv", heads, head_dim]) for n in ("key", "value")]
    outputs.append(helper.make_tensor_value_info("cache_out", elem, list(cache_out_shape)))
    graph = helper.make_graph(nodes, "key_value_cache_from_standard_ops", graph_inputs, outputs,
                              initializer=initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=10 if opset <= 21 else 11)


def baseline_model(inputs: dict, layout: int, layer: int = 0):
    """The ScatterND + Gather graph (opset 21) for the shapes of ``inputs``; outputs key, value, cache_out."""
    import onnx
    from onnx import helper

    if layout not in LAYOUTS:
        raise ValueError(f"the standard-ops baseline covers layouts {LAYOUTS}, got {layout}")
    elem = helper.np_dtype_to_tensor_dtype(inputs["current_key"].dtype)
    tokens, heads, head_dim = inputs["current_key"].shape
    gathers, row_inputs, row_shape = _gather_outputs("cache_out", _row_shape(inputs["cache"].shape, layout), layout)
    # One ScatterND for keys and values: each would copy the whole cache into its output were that not bound to the
    # cache's memory (baseline_runner binds it there; a second ScatterND's input would be the first's output).
    nodes = [helper.make_node("Concat", ["current_key", "current_value"], ["updates"], axis=0),
             helper.make_node("ScatterND", ["cache", "store_rows", "updates"], ["cache_out"])] + gathers
    index_shape = [2 * tokens, 3] if layout == 0 else [2 * tokens, heads, 4]
    graph_inputs = [helper.make_tensor_value_info("current_key", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("current_value", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("cache", elem, list(inputs["cache"].shape)),
                    helper.make_tensor_value_info("store_rows", onnx.TensorProto.INT64, index_shape)] + row_inputs
    return _model(nodes, graph_inputs, inputs, inputs["cache"].shape, row_shape, OPSET)


def baseline_runner(inputs: dict, page_size: int, layout: int, threads: int, config: dict | None = None):
    """(run, outputs): the paged baseline with every input and output bound once (IOBinding); ``inputs["cache"]``
    (C-contiguous) is both the graph's cache input and its cache_out output, so each run writes the caller's cache in
    place, like the op. ``outputs`` holds key and value, and cache_out (that cache)."""
    from ..bound_session import aligned_empty, bound_run

    if not inputs["cache"].flags.c_contiguous:
        raise ValueError("the paged baseline updates the cache in place: give a C-contiguous cache")
    feeds = baseline_feeds(inputs, page_size, layout)
    kv_shape = (len(feeds["key_rows"]),) + inputs["current_key"].shape[1:]
    outputs = {"key": aligned_empty(kv_shape, inputs["current_key"].dtype),
               "value": aligned_empty(kv_shape, inputs["current_key"].dtype), "cache_out": inputs["cache"]}
    return bound_run(baseline_model(inputs, layout), feeds, outputs, threads, config), outputs


@functools.lru_cache(maxsize=None)
def tensor_scatter_available() -> bool:
    """True when the installed ONNX Runtime runs ONNX's TensorScatter (opset 24) on its CPU EP."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("TensorScatter", ["past", "update", "index"], ["present"], axis=1)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 2]),
                                                helper.make_tensor_value_info("update", TensorProto.FLOAT, [1, 1]),
                                                helper.make_tensor_value_info("index", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", TENSOR_SCATTER_OPSET)], ir_version=11)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the probe's own copy of past_cache is not worth a warning
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        present = session.run(None, {"past": np.zeros((1, 2), np.float32), "update": np.ones((1, 1), np.float32),
                                     "index": np.array([1], np.int64)})[0]
    except Exception:  # noqa: BLE001 - any refusal (unknown op, opset too new) means "not implemented"
        return False
    return present.tolist() == [[0.0, 1.0]]


def offset_capacity(inputs: dict) -> int:
    """MaxS of an offset call the TensorScatter baseline can run: every sequence b owns slots [b * MaxS,
    (b + 1) * MaxS) of a one-layer layout-0 cache and stores the same number of tokens; ``ValueError`` otherwise."""
    cache, starts = inputs["cache"], np.asarray(inputs["cachestarts"], np.int64)
    batch = starts.size
    seqlens = np.diff(np.asarray(inputs["seqstarts"], np.int64))
    if cache.ndim != 5 or cache.shape[1] != 1 or batch == 0 or cache.shape[0] % batch:
        raise ValueError("the TensorScatter baseline needs a one-layer layout-0 cache split evenly between sequences")
    capacity = cache.shape[0] // batch
    if not np.array_equal(starts, np.arange(batch) * capacity) or np.any(seqlens != seqlens[0]):
        raise ValueError("the TensorScatter baseline needs cachestarts[b] == b * MaxS and equal seqlens")
    return capacity


def offset_baseline_model(inputs: dict, capacity: int):
    """The TensorScatter + Gather graph (opset 24) of an offset call (see :func:`offset_capacity`); inputs
    current_key/value, ``cache`` as ``(B, MaxS, 1, 2, H, Dh)``, ``write_indices`` (start_pos) and the rows
    ``key_rows`` / ``value_rows`` (:func:`gather_rows`, layout 0); outputs key, value, cache_out (TensorScatter's
    present cache)."""
    import onnx
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(inputs["current_key"].dtype)
    tokens, heads, head_dim = inputs["current_key"].shape
    batch = np.asarray(inputs["cachestarts"]).size
    seqlen = tokens // batch
    view = [batch, capacity, 1, 2, heads, head_dim]
    nodes = [helper.make_node("Reshape", ["current_key", "update_half"], ["key_update"]),
             helper.make_node("Reshape", ["current_value", "update_half"], ["value_update"]),
             helper.make_node("Concat", ["key_update", "value_update"], ["update"], axis=3),
             helper.make_node("TensorScatter", ["cache", "update", "write_indices"], ["cache_out"], axis=1,
                              mode="linear")]
    gathers, row_inputs, row_shape = _gather_outputs("cache_out", _row_shape(view, 0), 0)
    shapes = [onnx.numpy_helper.from_array(np.array([batch, seqlen, 1, 1, heads, head_dim], np.int64), "update_half")]
    graph_inputs = [helper.make_tensor_value_info("current_key", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("current_value", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("cache", elem, view),
                    helper.make_tensor_value_info("write_indices", onnx.TensorProto.INT64, [batch])] + row_inputs
    return _model(nodes + gathers, graph_inputs, inputs, view, shapes + row_shape, TENSOR_SCATTER_OPSET)


def offset_baseline_runner(inputs: dict, threads: int, config: dict | None = None):
    """(run, outputs): the offset baseline bound once; ``inputs["cache"]`` is both the graph's cache input and
    its cache_out output (TensorScatter then updates it in place), so each run writes the caller's cache like
    the op. ``outputs`` holds key and value."""
    from ..bound_session import aligned_empty, bound_run

    capacity = offset_capacity(inputs)
    _, gather = call_slots(inputs["seqstarts"], inputs["kvstarts"], inputs["cachestarts"], inputs["start_pos"],
                           cache_mode=0, page_size=1)
    tokens, heads, head_dim = inputs["current_key"].shape
    view = inputs["cache"].reshape(-1, capacity, 1, 2, heads, head_dim)  # the same memory
    feeds = {"current_key": inputs["current_key"], "current_value": inputs["current_value"], "cache": view,
             "write_indices": np.asarray(inputs["start_pos"], np.int64),
             **gather_rows(inputs["cache"].shape, 0, 0, gather)}
    outputs = {"key": aligned_empty((gather.size, heads, head_dim), inputs["current_key"].dtype),
               "value": aligned_empty((gather.size, heads, head_dim), inputs["current_key"].dtype), "cache_out": view}
    return bound_run(offset_baseline_model(inputs, capacity), feeds, outputs, threads, config), outputs
