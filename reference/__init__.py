"""Pure-numpy reference of opmx.dynamic_batching::KeyValueCache; it defines the semantics.

The normative text is spec/KeyValueCache.md; on a mismatch the spec wins.
"""

from .dtypes import BFLOAT16, INT4
from .key_value_cache import key_value_cache
from .layout import cache_shape, canonical_view
from .op_run import KeyValueCache
from .quantize import dequantize, pack_int4, quantize, unpack_int4
from .rotary import apply_rope, key_cache_rotary_shift, rotary_shift_tables
from .rotary_op_run import KeyCacheRotaryShift
from .validate import Attributes, KeyValueCacheError

__all__ = [
    "BFLOAT16", "INT4", "Attributes", "KeyCacheRotaryShift", "KeyValueCache", "KeyValueCacheError", "apply_rope",
    "cache_shape", "canonical_view", "dequantize", "key_cache_rotary_shift", "key_value_cache", "pack_int4",
    "quantize", "rotary_shift_tables", "unpack_int4",
]
