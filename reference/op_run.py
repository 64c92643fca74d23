"""``KeyValueCache`` for ``onnx.reference.ReferenceEvaluator(model, new_ops=[KeyValueCache])``."""

from onnx.reference.op_run import OpRun

from .key_value_cache import key_value_cache
from .op_attributes import node_attributes


class KeyValueCache(OpRun):
    """Runs :func:`key_value_cache`; ``cache`` and ``scale`` feeds are written in place."""

    op_domain = "opmx.dynamic_batching"

    def _run(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen,
             max_kvlen, cache, scale=None, **given):
        return key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               max_seqlen, max_kvlen, cache, scale,
                               **node_attributes(key_value_cache, "KeyValueCache", given))
