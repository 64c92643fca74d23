"""Normative specs of the opmx.dynamic_batching ops: the ONNX schemas (registered on import) and model
helpers. The prose lives next to this file (KeyValueCache.md, KeyCacheRotaryShift.md, MultiHeadAttention.md);
``conformance/`` holds a committed sample of the vectors that ``kvcache_op.validation`` writes.

The top of the house: it imports only onnx and numpy."""

from .mha_schema import make_attention_model
from .mha_schema import register as register_attention
from .mhca_schema import make_cache_attention_model
from .mhca_schema import register as register_cache_attention
from .model import IR_VERSION, make_model, make_node
from .rotary_schema import make_rotary_shift_model
from .rotary_schema import register as register_rotary_shift
from .schema import ATTRIBUTE_DEFAULTS, DOMAIN, INPUTS, OP_TYPE, OUTPUTS, VERSION, register

SCHEMA = register()
ROTARY_SHIFT_SCHEMA = register_rotary_shift()
ATTENTION_SCHEMA = register_attention()
CACHE_ATTENTION_SCHEMA = register_cache_attention()

__all__ = ["ATTENTION_SCHEMA", "ATTRIBUTE_DEFAULTS", "CACHE_ATTENTION_SCHEMA", "DOMAIN", "INPUTS", "IR_VERSION", "OP_TYPE", "OUTPUTS", "SCHEMA",
           "VERSION", "ROTARY_SHIFT_SCHEMA", "make_attention_model", "make_cache_attention_model", "make_model", "make_node", "make_rotary_shift_model",
           "register", "register_attention", "register_cache_attention", "register_rotary_shift"]
