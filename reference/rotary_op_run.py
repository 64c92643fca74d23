"""``KeyCacheRotaryShift`` for ``onnx.reference.ReferenceEvaluator``."""

from onnx.reference.op_run import OpRun

from .op_attributes import node_attributes
from .rotary import key_cache_rotary_shift


class KeyCacheRotaryShift(OpRun):
    """Runs :func:`key_cache_rotary_shift`; the ``cache``/``scale`` feeds are written in place."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, cache, scale, slots, cos, sin, **given):
        return (key_cache_rotary_shift(cache, scale, slots, cos, sin,
                                       **node_attributes(key_cache_rotary_shift, "KeyCacheRotaryShift", given)),)
