"""Serving exported decoders in ONNX Runtime: :class:`Engine` (continuous batching over the paged cache
manager: ``generate`` for a batch, ``submit`` from any thread returning a :class:`RequestHandle`), :func:`step_feeds` (a manager's step plan as the graph's feeds) and :class:`ModelInfo` (what
an exported file tells the engine); :class:`TextStream` and :class:`StopMatcher` turn streamed token ids into
text (whole characters only; stop strings across token edges).

It may import ``kvcache_op.manager``, ``kvcache_op.ort_ops``, ``kvcache_op.spec`` and ``kvcache_op.reference``."""

from .engine import Engine
from .sampling import SamplingParams, TokenLogprobs
from .model_info import ModelInfo
from .online import EngineBusy, RequestHandle
from .ort_runner import ModelRunner, default_providers
from .step_feeds import step_feeds
from .text import StopMatcher, TextStream

__all__ = ["Engine", "EngineBusy", "ModelInfo", "RequestHandle", "SamplingParams", "ModelRunner", "StopMatcher",
           "TextStream", "TokenLogprobs", "default_providers", "step_feeds"]
