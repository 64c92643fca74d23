"""The element types the spec allows, as numpy dtypes.

bfloat16 and int4 have no native numpy dtype; they are the ``ml_dtypes`` types that
``onnx.numpy_helper`` and ``onnx.reference`` use for ``BFLOAT16`` and ``INT4`` tensors.
"""

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
INT4 = np.dtype(ml_dtypes.int4)

#: T1: current_key, current_value, key, value.
T1_TYPES = (np.dtype(np.float32), np.dtype(np.float16), BFLOAT16)
#: T3: scale.
T3_TYPES = (np.dtype(np.float32), np.dtype(np.float16))
#: cache dtype (T2) required by each quant_bit; ``None`` means "the same as T1".
CACHE_TYPE_FOR_QUANT_BIT = {0: None, 8: np.dtype(np.int8), 4: INT4}
#: largest code magnitude per quant_bit (symmetric, so -QMAX..QMAX).
QMAX = {8: 127, 4: 7}
#: lower bound of every scale, in float32.
SCALE_EPS = np.float32(1e-5)


def dtype_name(dtype) -> str:
    """Short readable name of a numpy dtype (``float16``, ``bfloat16``, ``int4``...)."""
    return np.dtype(dtype).name


def saturating_cast(values: np.ndarray, dtype) -> np.ndarray:
    """float32 ``values`` rounded to ``dtype`` (to nearest even), a finite value past its largest finite value given
    that value of its sign rather than an infinity (an attention output: spec/MultiHeadAttention.md); inf and NaN
    kept."""
    values = np.asarray(values, np.float32)
    with np.errstate(over="ignore"):
        out = values.astype(dtype)
    if np.dtype(dtype) != np.float32:
        past = np.isfinite(values) & ~np.isfinite(out.astype(np.float32))
        if past.any():
            out[past] = (np.sign(values[past]) * np.float32(ml_dtypes.finfo(dtype).max)).astype(dtype)
    return out
