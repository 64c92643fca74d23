"""Hugging Face ``transformers`` decoders exported as packed dynamic-batching ONNX graphs that use the ops, through
the model's own forward with its attention routed to the ops (any family whose attention goes through transformers'
attention interface; what the graph cannot express is refused by name); served by
:class:`kvcache_op.serving.Engine`.

Install with ``pip install "kvcache-op[hf]"`` (``transformers`` and the pinned torch). It may import
``kvcache_op.torch`` (the ops it exports), ``kvcache_op.serving`` (to check the engine against the model's own
generation) and everything they import.
"""

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError("kvcache_op.hf needs transformers: pip install \"kvcache-op[hf]\"") from error

from .decoder import CacheSettings, PackedDecoder, decoder_sizes
from .export import export_model, load_model
from .tiny import tiny_config, tiny_model
from .tiny_checkpoint import tiny_checkpoint

__all__ = ["CacheSettings", "PackedDecoder", "decoder_sizes", "export_model", "load_model", "tiny_checkpoint",
           "tiny_config", "tiny_model"]
