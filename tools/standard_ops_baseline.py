"""What a user without the op would run: one paged KeyValueCache step composed from ONNX Runtime's built-in
ops — ScatterND stores this step's keys/values into the cache, Gather loads every sequence's slots — with
the slot indices computed on the host, as a cache manager would hand them over.

Unquantized caches in layouts 0 ``(MaxT, L, 2, H, Dh)`` and 3 ``(L, 2, H, MaxT, Dh)``. Standard ops have
no in-place update: ScatterND returns a new cache (a copy of the whole cache, then the scatter), which the
graph outputs as ``cache_out``. Both ops only copy, so the baseline reproduces the op's bits exactly.
"""

import numpy as np

LAYOUTS = (0, 3)


def slots_of(indices: dict, page_size: int) -> tuple:
    """(store slots ``[T]``, gather slots ``[sum KV]``) of a paged call, from its index inputs."""
    seqstarts, kvstarts, table = indices["seqstarts"], indices["kvstarts"], indices["cachestarts"]
    store, gather = [], []
    for b in range(len(seqstarts) - 1):
        start = int(indices["start_pos"][b])
        for pos in range(start, start + int(seqstarts[b + 1] - seqstarts[b])):
            store.append(table[b, pos // page_size] + pos % page_size)
        for pos in range(int(kvstarts[b + 1] - kvstarts[b])):
            gather.append(table[b, pos // page_size] + pos % page_size)
    return np.asarray(store, np.int64), np.asarray(gather, np.int64)


def baseline_feeds(inputs: dict, page_size: int, layout: int, layer: int = 0) -> dict:
    """The baseline graph's inputs: the data tensors and the scatter/gather indices for ``layout``."""
    store, gather = slots_of(inputs, page_size)
    tokens, heads = inputs["current_key"].shape[:2]
    feeds = {"current_key": inputs["current_key"], "current_value": inputs["current_value"], "cache": inputs["cache"],
             "gather_slots": gather}
    for kv, name in ((0, "store_key"), (1, "store_value")):
        if layout == 0:  # one (slot, layer, kv) index per token, updating an (H, Dh) block
            feeds[name] = np.stack([store, np.full(tokens, layer), np.full(tokens, kv)], axis=1).astype(np.int64)
        else:  # one (layer, kv, h, slot) index per token and head, updating a Dh row
            h = np.broadcast_to(np.arange(heads), (tokens, heads))
            s = np.broadcast_to(store[:, None], (tokens, heads))
            feeds[name] = np.stack([np.full_like(s, layer), np.full_like(s, kv), h, s], axis=2).astype(np.int64)
    return feeds


def baseline_model(inputs: dict, layout: int, layer: int = 0):
    """The ScatterND + Gather graph (opset 21) for the shapes of ``inputs``; outputs key, value, cache_out."""
    import onnx
    from onnx import helper

    if layout not in LAYOUTS:
        raise ValueError(f"the standard-ops baseline covers layouts {LAYOUTS}, got {layout}")
    elem = helper.np_dtype_to_tensor_dtype(inputs["current_key"].dtype)
    tokens, heads, head_dim = inputs["current_key"].shape

    def scalar(name, value):
        return onnx.numpy_helper.from_array(np.array(value, np.int64), name)

    nodes = [helper.make_node("ScatterND", ["cache", "store_key", "current_key"], ["with_keys"]),
             helper.make_node("ScatterND", ["with_keys", "store_value", "current_value"], ["cache_out"])]
    if layout == 0:  # (MaxT, L, 2, H, Dh): gather slots, then pick the layer and the K/V half
        nodes += [helper.make_node("Gather", ["cache_out", "gather_slots"], ["rows"], axis=0),
                  helper.make_node("Gather", ["rows", "layer"], ["layer_rows"], axis=1),
                  helper.make_node("Gather", ["layer_rows", "k"], ["key"], axis=1),
                  helper.make_node("Gather", ["layer_rows", "v"], ["value"], axis=1)]
    else:  # (L, 2, H, MaxT, Dh): pick the layer and half, gather slots, then (KV, H, Dh)
        nodes += [helper.make_node("Gather", ["cache_out", "layer"], ["halves"], axis=0)]
        for half, out in (("k", "key"), ("v", "value")):
            nodes += [helper.make_node("Gather", ["halves", half], [f"{out}_heads"], axis=0),
                      helper.make_node("Gather", [f"{out}_heads", "gather_slots"], [f"{out}_hkd"], axis=1),
                      helper.make_node("Transpose", [f"{out}_hkd"], [out], perm=[1, 0, 2])]
    index_shape = [tokens, 3] if layout == 0 else [tokens, heads, 4]
    graph_inputs = [helper.make_tensor_value_info("current_key", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("current_value", elem, [tokens, heads, head_dim]),
                    helper.make_tensor_value_info("cache", elem, list(inputs["cache"].shape)),
                    helper.make_tensor_value_info("store_key", onnx.TensorProto.INT64, index_shape),
                    helper.make_tensor_value_info("store_value", onnx.TensorProto.INT64, index_shape),
                    helper.make_tensor_value_info("gather_slots", onnx.TensorProto.INT64, ["kv"])]
    outputs = [helper.make_tensor_value_info(n, elem, ["kv", heads, head_dim]) for n in ("key", "value")]
    outputs.append(helper.make_tensor_value_info("cache_out", elem, list(inputs["cache"].shape)))
    graph = helper.make_graph(nodes, "key_value_cache_from_standard_ops", graph_inputs, outputs,
                              initializer=[scalar("layer", layer), scalar("k", 0), scalar("v", 1)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def baseline_runner(inputs: dict, page_size: int, layout: int, threads: int):
    """(run, outputs): the baseline with every input and output bound once (IOBinding); ``outputs`` holds
    key, value and cache_out, written by each run."""
    from .bound_session import bound_run

    feeds = baseline_feeds(inputs, page_size, layout)
    kv_shape = (len(feeds["gather_slots"]),) + inputs["current_key"].shape[1:]
    outputs = {"key": np.empty(kv_shape, inputs["current_key"].dtype),
               "value": np.empty(kv_shape, inputs["current_key"].dtype),
               "cache_out": np.empty_like(inputs["cache"])}
    return bound_run(baseline_model(inputs, layout), feeds, outputs, threads), outputs
