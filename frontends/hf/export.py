"""``export_model``: a ``transformers`` causal LM to a packed dynamic-batching ONNX graph using the ops."""

from __future__ import annotations

import dataclasses
import functools
import gc
import numbers
import os
import re

import numpy as np
import torch

from .. import torch as kt
from ..torch import export as torch_export
from ..torch.model_files import check_writable, save_whole, weight_bytes
from ..serving.decoder_io import INPUT_NAMES, OUTPUT_NAME
from ..serving.model_info import ModelInfo
from .decoder import CacheSettings, PackedDecoder
from .graph_rewrites import optimized_ir

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Example sizes for tracing, pairwise different so no two dynamic axes are taken for one another:
# T = 4 tokens, B = 2 sequences (B + 1 = 3), P = 5 pages per table, MaxT = 7 pages of slots.
_EXAMPLE_PAGES, _EXAMPLE_TABLE = 7, 5
#: The largest page an export takes: its tracing step holds a cache of _EXAMPLE_PAGES pages (a page of 4,096 slots of
#: a 32-layer model with 8 heads of 128 in float32: 1 GiB each), and serving engines page in tens of slots.
MAX_PAGE_SIZE = 4096


def _torch_dtype(dtype, model) -> torch.dtype:
    if dtype is None:
        return next(model.parameters()).dtype
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return dtype


def load_model(model):
    """``model`` itself, or the causal LM of a local checkpoint folder (``AutoModelForCausalLM``, no
    download), loaded in float32."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(model):
            raise FileNotFoundError(f"no checkpoint folder at {model}")
        # float32: checkpoints usually ship bfloat16 weights, which ONNX Runtime's CPU EP cannot compute with
        return AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True, dtype=torch.float32)
    return model


def example_inputs(decoder: PackedDecoder) -> dict:
    """A valid two-sequence step (a decode and a 3-token prefill) on a zeroed cache, for tracing."""
    s, c = decoder.shape, decoder.cache
    ps = c.page_size
    cache, scale = kt.new_cache(num_layer=s.num_layers, max_tokens=_EXAMPLE_PAGES * ps, heads=s.num_kv_heads,
                                head_dim=s.head_dim, dtype=c.dtype, quant_bit=c.quant_bit, quant_group=c.quant_group,
                                scale_dtype=c.scale_dtype, cache_layout=c.cache_layout)
    table = np.full((2, _EXAMPLE_TABLE), -1, np.int64)
    pages = -(-3 // ps)  # each sequence holds 3 positions: [0, 3)
    for b in range(2):
        table[b, :pages] = [(b * pages + i) * ps for i in range(pages)]
    feeds = dict(
        input_ids=torch.tensor([1, 2, 3, 4], dtype=torch.long) % s.vocab_size,
        positions=torch.tensor([2, 0, 1, 2], dtype=torch.long),
        seqstarts=torch.tensor([0, 1, 4]), kvstarts=torch.tensor([0, 3, 6]),
        cachestarts=torch.from_numpy(table), start_pos=torch.tensor([2, 0]),
        decoding_batches=torch.tensor(1), max_seqlen=torch.tensor(3), max_kvlen=torch.tensor(3),
        cache=cache)
    if scale is not None:
        feeds["scale"] = scale
    return feeds


def _cache_axis(settings: CacheSettings) -> int:
    from ..reference.layout import LAYOUT_AXES

    return LAYOUT_AXES[settings.cache_layout].index("MaxT")


def _keeps_training_mode(export):
    """``export`` leaving each module of a caller's model in the training mode it was given in (the export runs it in
    eval mode; a model in training may keep some modules in eval)."""
    @functools.wraps(export)
    def wrapper(model, *args, **kwargs):
        modes = {m: m.training for m in model.modules()} if isinstance(model, torch.nn.Module) else {}
        try:
            return export(model, *args, **kwargs)
        finally:
            for module, training in modes.items():
                module.training = training
    return wrapper


@_keeps_training_mode
def export_model(model, path, *, page_size: int = 16, quant_bit: int = 0, cache_layout: int = 1, dtype=None,
                 quant_group: int = 8, fused_attention: bool = True, dynamo: bool = True, verbose: bool = False,
                 metadata: dict = None, optimize: bool = True, progress=None) -> str:
    """Exports a causal LM (a ``transformers`` model or a local checkpoint folder) to ``path`` through its own
    forward, with its attention routed to the ops, and returns the path. The graph runs one step of a dynamic batch (see
    :class:`~kvcache_op.hf.decoder.PackedDecoder` for its inputs); each layer's attention is one
    MultiHeadCacheAttention node reading one shared paged cache in place (``cache_mode=1``, ``layer_idx`` per
    layer), or with ``fused_attention=False`` the split pair KeyValueCache then MultiHeadAttention; the rest is
    standard ONNX. ``dtype`` is the cache's and attention's element type (default: the model's); the rest
    of the graph computes in the model's dtype. ``quant_bit`` 8 or 4 stores the cache quantized (int8 /
    int4 codes, a scale per ``quant_group`` elements). ``cache_layout`` defaults to 1 (layer, slot, kv, head): each
    layer's slots lie together, so the fused attention reads them as one stream (measured, 4 layers, head_dim 32:
    2.4 ms per layer in layout 1 against 7.6 ms in layout 0, whose slots interleave the layers). The file carries
    :class:`~kvcache_op.serving.ModelInfo` as metadata. ``dynamo`` picks torch's exporter (``False``: the TorchScript one); ``verbose`` shows its
    progress; ``metadata``: more ``metadata_props`` to write (e.g. where the checkpoint came from). ``optimize``
    applies :func:`~kvcache_op.hf.graph_rewrites.optimize_decoder` (fused norms, sibling MatMuls and rotary
    embeddings, for every family). The file appears whole or not at all, its weights in a data file beside it when
    they pass 1 GiB (:func:`~kvcache_op.torch.model_files.save_whole`). ``ValueError`` for a model or setting the
    graph cannot express, or a setting not of its type (the integer ones, ``fused_attention`` a bool);
    ``FileNotFoundError``/``ValueError`` for a ``path`` that cannot be written, before any export work. The caller's
    model comes back in the training mode it came in. ``progress(text)``, when given, is told each stage as it begins
    (a large model's export takes minutes)."""
    tell = progress or (lambda text: None)
    for name, value in (("page_size", page_size), ("quant_bit", quant_bit), ("quant_group", quant_group),
                        ("cache_layout", cache_layout)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # 2.7 is no page size, True no bit
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if not isinstance(fused_attention, bool):  # bool("false") is True
        raise ValueError(f"fused_attention must be True or False, got {fused_attention!r}")
    check_writable(path)  # before minutes of export, not after them
    loaded = not isinstance(model, torch.nn.Module)  # the module is this call's own: freed as its weights are replaced
    model = load_model(model)
    settings = CacheSettings(page_size=int(page_size), quant_bit=int(quant_bit), quant_group=int(quant_group),
                             cache_layout=int(cache_layout), dtype=_torch_dtype(dtype, model),
                             fused_attention=fused_attention)
    if not 1 <= settings.page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be 1 to {MAX_PAGE_SIZE}, got {page_size}")
    if settings.quant_bit not in (0, 4, 8) or settings.cache_layout not in (0, 1, 2, 3):
        raise ValueError(f"quant_bit must be 0, 4 or 8 and cache_layout 0..3, got {quant_bit}, {cache_layout}")
    tell("probing the model's sizes and checking its routed forward against its own")
    decoder = PackedDecoder(model, settings).eval()
    feeds = example_inputs(decoder)
    names = [n for n in INPUT_NAMES if n in feeds]
    axes = {"input_ids": {0: "tokens"}, "positions": {0: "tokens"}, "seqstarts": {0: "batch_plus_1"},
            "kvstarts": {0: "batch_plus_1"}, "cachestarts": {0: "batch", 1: "table_pages"}, "start_pos": {0: "batch"},
            "cache": {_cache_axis(settings): "cache_slots"}, "scale": {_cache_axis(settings): "cache_slots"}}
    if dynamo:
        shapes = {n: ({a: torch.export.Dim.DYNAMIC for a in axes[n]} if n in axes else None) for n in names}
        kwargs = dict(dynamic_shapes=shapes, input_names=names, output_names=[OUTPUT_NAME], verbose=verbose)
    else:
        kwargs = dict(input_names=names, output_names=[OUTPUT_NAME], verbose=verbose,
                      dynamic_axes={**{n: axes[n] for n in names if n in axes}, OUTPUT_NAME: {0: "batch"}})
    path = os.fspath(path)
    tell(f"tracing it with torch's {'dynamo' if dynamo else 'TorchScript'} ONNX exporter and checking the graph")
    with torch.no_grad():
        try:
            exported = torch_export.checked_export(decoder, tuple(feeds[n] for n in names), dynamo=dynamo,
                                                   work_folder=os.path.dirname(os.path.abspath(path)), **kwargs)
        except Exception as error:
            unconverted = re.search(r"No ONNX function found for (\S+)", str(error))
            if unconverted is None:
                raise
            raise ValueError(f"the model computes {unconverted.group(1).rstrip('.,:')}, which torch's ONNX exporter "
                             f"has no function for: it cannot be exported (switch the feature that uses it off in "
                             f"the config where it has a switch)") from None
    info, max_positions = model_info(decoder), decoder.shape.max_positions
    # In onnx_ir from here on. A dynamo export's tensors are the module's own: where this call loaded the module, only
    # the graph holds them once it is dropped, and a weight a rewrite replaces (a transposed or merged MatMul weight)
    # is freed as it goes; the caller's own module keeps its weights. ir.save writes them out one by one.
    del decoder, feeds
    if loaded:
        del model
        gc.collect()  # the exporter's reference cycles hold the module
    if optimize:
        tell("rewriting the graph (fused norms, merged MatMuls, rotary tables)")
        exported, _ = optimized_ir(exported, max_positions)
    exported.metadata_props.update({**(metadata or {}), **info.to_metadata()})
    tell(f"writing the graph and {weight_bytes(exported) / 1e9:.2f} GB of weights")
    save_whole(exported, path)
    return path


def model_info(decoder: PackedDecoder) -> ModelInfo:
    """The engine's view of an exported decoder: its sizes and its cache settings."""
    c = decoder.cache
    dtype_name = {v: k for k, v in DTYPES.items()}
    return ModelInfo(**dataclasses.asdict(decoder.shape), page_size=c.page_size, quant_bit=c.quant_bit,
                     quant_group=c.quant_group, cache_layout=c.cache_layout, cache_dtype=dtype_name[c.dtype],
                     scale_dtype=dtype_name[c.scale_dtype] if c.quant_bit else "")
