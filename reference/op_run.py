"""``KeyValueCache`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[KeyValueCache])``."""

from onnx.reference.op_run import OpRun

from .key_value_cache import key_value_cache


class KeyValueCache(OpRun):
    """Runs :func:`key_value_cache`; ``cache`` and ``scale`` feeds are written in place."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
             max_kvlen, cache, scale=None, num_layer=None, layer_idx=None, quant_bit=None, quant_group=None,
             num_repeat=None, cache_mode=None, cache_layout=None, page_size=None):
        given = dict(num_layer=num_layer, layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                     num_repeat=num_repeat, cache_mode=cache_mode, cache_layout=cache_layout,
                     page_size=page_size)
        attrs = {k: int(v) for k, v in given.items() if v is not None}
        return key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               max_seqlen, max_kvlen, cache, scale, **attrs)
