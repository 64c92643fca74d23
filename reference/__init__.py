"""Pure-numpy references of the opmx.dynamic_batching ops (KeyValueCache, KeyCacheRotaryShift,
MultiHeadAttention, MultiHeadCacheAttention); they define the semantics.

The normative texts are spec/<Op>.md; on a mismatch the spec wins. It imports only numpy and onnx: every other
part of the package may hold itself to it, and it depends on none of them.
"""

from .dtypes import BFLOAT16, INT4
from .key_value_cache import key_value_cache
from .attention_tolerance import attention_error_bound, attention_exact, attention_tolerance
from .layout import cache_shape, canonical_view
from .mha_op_run import MultiHeadAttention
from .mhca_op_run import MultiHeadCacheAttention
from .mha_validate import MultiHeadAttentionError
from .multi_head_attention import alibi_slope, alibi_slopes, multi_head_attention
from .multi_head_cache_attention import cache_attention_tolerance, multi_head_cache_attention
from .op_run import KeyValueCache
from .quantize import dequantize, pack_int4, quantize, unpack_int4
from .rotary import apply_rope, key_cache_rotary_shift, rotary_shift_tables
from .rotary_op_run import KeyCacheRotaryShift
from .validate import Attributes, KeyValueCacheError

__all__ = [
    "BFLOAT16", "INT4", "Attributes", "KeyCacheRotaryShift", "KeyValueCache", "KeyValueCacheError", "MultiHeadAttention",
    "MultiHeadAttentionError", "MultiHeadCacheAttention", "alibi_slope", "alibi_slopes", "apply_rope", "attention_error_bound", "attention_exact", "attention_tolerance", "cache_attention_tolerance",
    "cache_shape", "canonical_view", "dequantize", "key_cache_rotary_shift", "key_value_cache",
    "multi_head_attention", "multi_head_cache_attention", "pack_int4", "quantize", "rotary_shift_tables", "unpack_int4",
]
