"""The checks that let the engine trust an exported decoder's ``kvcache_op.*`` metadata: every value has the
type and range the exporter writes, and the graph agrees with it (its inputs, its cache's type and shape, and
the attributes of every MultiHeadCacheAttention node, or of every KeyValueCache and MultiHeadAttention node). A file edited by hand, or exported by
another tool, is refused with every mismatch named before anything runs, instead of running with the wrong
page size, window or cache type."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..spec import DOMAIN, mha_schema, mhca_schema, schema
from .decoder_io import INPUT_NAMES, OUTPUT_NAME

FLOAT_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
CACHE_TYPES = {8: TensorProto.INT8, 4: TensorProto.INT4}
# name -> (what it must be, check); bool is an int in Python and is refused wherever an integer is meant.
_INT = (lambda v: isinstance(v, int) and not isinstance(v, bool))
_NUMBER = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_FIELDS = {
    "family": ("a string", lambda v: isinstance(v, str)),
    "num_layers": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "num_heads": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "num_kv_heads": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "head_dim": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "vocab_size": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "max_positions": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "sliding_windows": ("a list of integers >= 0", lambda v: isinstance(v, tuple) and all(_INT(w) and w >= 0 for w in v)),
    # Empty: no single set of frequencies moves the model's cached keys (StreamingLLM's shift is unavailable).
    "inv_freq": ("a list of finite numbers > 0",
                 lambda v: isinstance(v, tuple) and all(_NUMBER(f) and 0 < f < math.inf for f in v)),
    "softmax_scale": ("a finite number > 0", lambda v: _NUMBER(v) and 0 < v < math.inf),
    "eos_token_ids": ("a list of integers >= 0", lambda v: isinstance(v, tuple) and all(_INT(t) and t >= 0 for t in v)),
    "page_size": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "quant_bit": ("0, 4 or 8", lambda v: _INT(v) and v in (0, 4, 8)),
    "quant_group": ("an integer >= 1", lambda v: _INT(v) and v >= 1),
    "cache_layout": ("0, 1, 2 or 3", lambda v: _INT(v) and v in (0, 1, 2, 3)),
    "cache_dtype": ("float32, float16 or bfloat16", lambda v: v in FLOAT_TYPES),
    "scale_dtype": ("float32, float16, bfloat16 or empty", lambda v: v in FLOAT_TYPES or v == ""),
}


def check_values(values: dict) -> None:
    """``ValueError`` naming every metadata value (already parsed from JSON) of the wrong type or range, or that
    contradicts another."""
    problems = [f"{name} = {values[name]!r} (must be {what})" for name, (what, ok) in _FIELDS.items()
                if name in values and not ok(values[name])]
    if not problems:
        v = values
        if v["num_heads"] % v["num_kv_heads"]:
            problems.append(f"num_heads = {v['num_heads']} is not a multiple of num_kv_heads = {v['num_kv_heads']}")
        if len(v["sliding_windows"]) != v["num_layers"]:
            problems.append(f"sliding_windows has {len(v['sliding_windows'])} entries for {v['num_layers']} layers")
        if (v["quant_bit"] == 0) != (v["scale_dtype"] == ""):
            problems.append(f"scale_dtype = {v['scale_dtype']!r} with quant_bit = {v['quant_bit']} (a scale exactly "
                            "when the cache is quantized)")
        if v["quant_bit"] and v["head_dim"] % v["quant_group"]:
            problems.append(f"quant_group = {v['quant_group']} does not divide head_dim = {v['head_dim']}")
        if 2 * len(v["inv_freq"]) > v["head_dim"]:
            problems.append(f"inv_freq has {len(v['inv_freq'])} frequencies: a rotary dim of {2 * len(v['inv_freq'])} "
                            f"> head_dim = {v['head_dim']}")
        if any(t >= v["vocab_size"] for t in v["eos_token_ids"]):
            problems.append(f"eos_token_ids {list(v['eos_token_ids'])} reach past vocab_size = {v['vocab_size']}")
    if problems:
        raise ValueError("the model's kvcache_op metadata is invalid: " + "; ".join(problems) + " (re-export it)")


def _attributes(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _dims(value_info) -> list:
    """The static size of each axis (None where symbolic)."""
    return [d.dim_value if d.HasField("dim_value") else None for d in value_info.type.tensor_type.shape.dim]


def check_graph(info, model: onnx.ModelProto) -> None:
    """``ValueError`` naming every place where the graph of ``model`` disagrees with ``info`` (its metadata)."""
    problems = []
    inputs = {i.name: i for i in model.graph.input}
    wanted = [n for n in INPUT_NAMES if n != "scale" or info.quant_bit]
    missing = [n for n in wanted if n not in inputs]
    if missing:
        problems.append(f"the graph lacks the inputs {missing} (a decoder exported by kvcache_op.hf has {wanted})")
    if info.quant_bit == 0 and "scale" in inputs:
        problems.append("the graph has a scale input but quant_bit is 0")
    outputs = {o.name: o for o in model.graph.output}
    if OUTPUT_NAME not in outputs:
        problems.append(f"the graph has no output {OUTPUT_NAME!r}")
    else:
        vocab = _dims(outputs[OUTPUT_NAME])[-1:]
        if vocab and vocab[0] is not None and vocab[0] != info.vocab_size:
            problems.append(f"the logits have {vocab[0]} columns, the metadata says vocab_size = {info.vocab_size}")
    cache = inputs.get("cache")
    if cache is not None:
        element = CACHE_TYPES.get(info.quant_bit, FLOAT_TYPES.get(info.cache_dtype))
        if cache.type.tensor_type.elem_type != element:
            problems.append(f"the cache input is {TensorProto.DataType.Name(cache.type.tensor_type.elem_type)}, "
                            f"not {TensorProto.DataType.Name(element)} (quant_bit {info.quant_bit}, cache_dtype "
                            f"{info.cache_dtype})")
        problems += _cache_shape_problems(info, _dims(cache), info.head_dim, "cache")
    scale = inputs.get("scale")
    if scale is not None and info.quant_bit:
        element = FLOAT_TYPES[info.scale_dtype]
        if scale.type.tensor_type.elem_type != element:
            problems.append(f"the scale input is {TensorProto.DataType.Name(scale.type.tensor_type.elem_type)}, "
                            f"not {TensorProto.DataType.Name(element)} (scale_dtype {info.scale_dtype})")
        problems += _cache_shape_problems(info, _dims(scale), info.head_dim // info.quant_group, "scale")
    problems += _attention_node_problems(model, info)
    if problems:
        raise ValueError("the model's kvcache_op metadata does not match its graph: " + "; ".join(problems) +
                         " (re-export it with kvcache_op.hf.export_model)")


def _attention_node_problems(model, info) -> list:
    """Each layer's attention: one MultiHeadCacheAttention node, or the split pair (KeyValueCache then
    MultiHeadAttention); one form for every layer, with the metadata's cache and attention attributes."""
    def nodes(op_type):
        return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == op_type]

    kv, attention, fused = nodes("KeyValueCache"), nodes("MultiHeadAttention"), nodes("MultiHeadCacheAttention")
    if not (len(fused) == info.num_layers and not kv and not attention) and \
            not (len(kv) == len(attention) == info.num_layers and not fused):
        return [f"the graph has {len(fused)} MultiHeadCacheAttention, {len(kv)} KeyValueCache and {len(attention)} "
                f"MultiHeadAttention nodes for num_layers = {info.num_layers} (one fused node or one pair per layer)"]
    expected_cache = dict(num_layer=info.num_layers, quant_bit=info.quant_bit, cache_mode=1,
                          cache_layout=info.cache_layout, page_size=info.page_size)
    if info.quant_bit:
        expected_cache["quant_group"] = info.quant_group
    problems = []
    for i, node in enumerate(kv):
        problems += _attribute_problems(f"KeyValueCache node {node.name or i!r}", _attributes(node),
                                        {**expected_cache, "layer_idx": i, "num_repeat": 1}, schema.ATTRIBUTE_DEFAULTS)
    for i, node in enumerate(attention + fused):
        window = info.sliding_windows[i] if i < len(info.sliding_windows) else None
        want = dict(num_heads=info.num_heads, head_dim=info.head_dim, num_kv_heads=info.num_kv_heads,
                    sliding_window=window, softmax_scale=info.softmax_scale)
        if node.op_type == "MultiHeadCacheAttention":
            want.update(expected_cache, layer_idx=i)
        problems += _attribute_problems(f"{node.op_type} node {node.name or i!r} (layer {i})", _attributes(node),
                                        want, mhca_schema.ATTRIBUTE_DEFAULTS)
    return problems


def _attribute_problems(where: str, got: dict, want: dict, defaults: dict = mha_schema.ATTRIBUTE_DEFAULTS) -> list:
    """``where``'s attributes (``got``, absent ones at the op's ``defaults``) against the metadata's (``want``)."""
    problems = []
    for name, value in want.items():
        have = got.get(name, defaults.get(name))
        if name == "num_kv_heads" and have == 0:
            have = want["num_heads"]  # 0 means as many as the query heads
        if name == "softmax_scale":  # a float32 attribute; 0 means 1/sqrt(head_dim)
            have = np.float32(have) if have else np.float32(1 / math.sqrt(want["head_dim"]))
            value = np.float32(value)
        if have != value:
            problems.append(f"{where} has {name} = {have}, the metadata says {value}")
    return problems


def _cache_shape_problems(info, dims: list, last: int, name: str) -> list:
    """The static axes of the cache (``last``: head_dim) or scale (head_dim / quant_group) input against the
    metadata: rank 5, layers, kv 2, heads and the last axis where they lie in ``info.cache_layout`` (an int4
    cache's last axis is not checked: logical or packed, as the exporter typed it)."""
    from ..reference.layout import cache_shape

    if len(dims) != 5:
        return [f"the {name} input has rank {len(dims)}, not 5"]
    if name == "cache" and info.quant_bit == 4:
        last = -1
    want = cache_shape(info.cache_layout, info.num_layers, -1, info.num_kv_heads, last)
    return [f"the {name} input's axis {axis} is {have}, the metadata (layout {info.cache_layout}) says {size}"
            for axis, (have, size) in enumerate(zip(dims, want)) if size != -1 and have is not None and have != size]


def rotary_table_rows(model: onnx.ModelProto):
    """The fewest rows (positions) in the cos table of any ``com.microsoft::RotaryEmbedding`` node of ``model``, or
    None where it has none with a constant table. The exported decoder feeds each such node a step's tokens as one
    sequence, and ONNX Runtime's RotaryEmbedding refuses a sequence longer than its table ("Updating cos_cache and
    sin_cache in RotaryEmbedding is not currently supported"): so no step may feed more tokens than this."""
    rows = {init.name: int(init.dims[0]) for init in model.graph.initializer if len(init.dims) == 2}
    found = [rows[node.input[2]] for node in model.graph.node
             if node.domain == "com.microsoft" and node.op_type == "RotaryEmbedding" and len(node.input) > 2
             and node.input[2] in rows]
    return min(found) if found else None
