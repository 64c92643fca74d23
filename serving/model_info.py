"""What an exported decoder carries for the engine, as ONNX ``metadata_props`` under ``kvcache_op.*`` keys:
the cache's attributes, the model's sizes, its rotary frequencies (for StreamingLLM's key shift) and
its per-layer sliding windows. The exporter writes it; the engine reads it and needs nothing else."""

from __future__ import annotations

import dataclasses
import json

from ..ort_ops.graph_rules import load_model
from .model_check import check_graph, check_values

PREFIX = "kvcache_op."
FORMAT_VERSION = 1


def _refuse_constant(name: str):
    """NaN and Infinity: Python's json reads them, standard JSON has no such values."""
    raise ValueError(f"{name} is not a JSON value")


@dataclasses.dataclass(frozen=True)
class DecoderSizes:
    """A decoder's sizes, rotary frequencies, per-layer windows and stop tokens."""

    family: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    sliding_windows: tuple  # per layer, 0 = full attention
    inv_freq: tuple  # rotary inverse frequencies (float32 values); rotary dim = 2 * len(inv_freq); empty when no
    # single set of frequencies moves the model's cached keys (per-layer-type rotary, interleaved pairs, ...)
    softmax_scale: float
    eos_token_ids: tuple  # generation stops after any of them; empty = never


@dataclasses.dataclass(frozen=True)
class ModelInfo(DecoderSizes):
    """Everything the engine needs to size the cache and drive the graph: the decoder and its cache."""

    page_size: int
    quant_bit: int
    quant_group: int
    cache_layout: int
    cache_dtype: str  # T1: "float32", "float16" or "bfloat16"
    scale_dtype: str  # T3 when quantized, else ""

    @property
    def uniform_window(self):
        """The window every layer shares (pages before it can be released), else ``None``."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 and 0 not in windows else None

    def to_metadata(self) -> dict:
        """The ``metadata_props`` entries (strings) that describe this model."""
        entries = {"format": str(FORMAT_VERSION)}
        for field in dataclasses.fields(self):
            entries[field.name] = json.dumps(getattr(self, field.name))
        return {PREFIX + k: v for k, v in entries.items()}

    @classmethod
    def from_metadata(cls, props: dict) -> "ModelInfo":
        """Reads what :meth:`to_metadata` wrote; ``ValueError`` naming the file's problem otherwise."""
        entries = {k[len(PREFIX):]: v for k, v in props.items() if k.startswith(PREFIX)}
        if not entries:
            raise ValueError("this ONNX model carries no kvcache_op metadata: export it with kvcache_op.hf.export_model")
        if entries.get("format") != str(FORMAT_VERSION):
            raise ValueError(f"kvcache_op metadata format {entries.get('format')!r} is not {FORMAT_VERSION}: re-export "
                             f"the model with this version of kvcache-op")
        values = {}
        for field in dataclasses.fields(cls):
            if field.name not in entries:
                raise ValueError(f"kvcache_op metadata lacks {field.name!r}: re-export the model")
            try:
                value = json.loads(entries[field.name], parse_constant=_refuse_constant)
            except ValueError:
                raise ValueError(f"kvcache_op metadata {field.name!r} is not JSON: {entries[field.name]!r} (re-export "
                                 "the model)") from None
            values[field.name] = tuple(value) if isinstance(value, list) else value
        check_values(values)
        return cls(**values)

    @classmethod
    def of_model(cls, model) -> "ModelInfo":
        """The info of a ``ModelProto`` or of the ONNX file at a path (weights not loaded), checked against the
        graph: ``ValueError`` naming every value the graph contradicts (:mod:`.model_check`)."""
        model = load_model(model)
        info = cls.from_metadata({p.key: p.value for p in model.metadata_props})
        check_graph(info, model)
        return info
