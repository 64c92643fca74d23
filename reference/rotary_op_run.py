"""``KeyCacheRotaryShift`` for ``onnx.reference.ReferenceEvaluator``."""

from onnx.reference.op_run import OpRun

from .rotary import key_cache_rotary_shift


class KeyCacheRotaryShift(OpRun):
    """Runs :func:`key_cache_rotary_shift`; the ``cache``/``scale`` feeds are written in place."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, cache, scale, slots, cos, sin, num_layer=None, layer_idx=None, cache_layout=None, quant_bit=None,
             quant_group=None, rotary_dim=None, rotary_interleaved=None):
        given = dict(num_layer=num_layer, layer_idx=layer_idx, cache_layout=cache_layout, quant_bit=quant_bit,
                     quant_group=quant_group, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved)
        return (key_cache_rotary_shift(cache, scale, slots, cos, sin,
                                       **{k: int(v) for k, v in given.items() if v is not None}),)
