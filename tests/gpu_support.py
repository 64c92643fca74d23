"""Device-side helpers for the GPU tests: device OrtValues from numpy and back (bfloat16 and int4 too)."""

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from kvcache_op.reference.dtypes import BFLOAT16, INT4
from kvcache_op.reference.quantize import pack_int4, unpack_int4

_ONNX_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
              BFLOAT16: TensorProto.BFLOAT16, np.dtype(np.int8): TensorProto.INT8, INT4: TensorProto.INT4,
              np.dtype(np.int64): TensorProto.INT64}


def _host_bytes(array: np.ndarray) -> np.ndarray:
    if array.dtype == INT4:
        return pack_int4(array)
    return np.ascontiguousarray(array).view(np.uint8).reshape(-1)


def to_device(array: np.ndarray, device_id: int = 0) -> ort.OrtValue:
    """A CUDA OrtValue holding a copy of ``array``."""
    import cupy

    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), _ONNX_TYPE[array.dtype], "cuda", device_id)
    data = _host_bytes(array)
    if data.size:
        cupy.cuda.runtime.memcpy(value.data_ptr(), data.ctypes.data, data.size, cupy.cuda.runtime.memcpyHostToDevice)
    return value


def from_device(value: ort.OrtValue, dtype) -> np.ndarray:
    """A host copy of a CUDA OrtValue of numpy ``dtype`` (bfloat16 and int4 included)."""
    import cupy

    dtype = np.dtype(dtype)
    shape = tuple(value.shape())
    count = int(np.prod(shape))
    nbytes = (count + 1) // 2 if dtype == INT4 else count * dtype.itemsize
    raw = np.empty(nbytes, np.uint8)
    if nbytes:
        cupy.cuda.runtime.memcpy(raw.ctypes.data, value.data_ptr(), nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
    if dtype == INT4:
        return unpack_int4(raw, count).astype(INT4).reshape(shape)
    return raw.view(dtype).reshape(shape)


def run_on_cuda(model, inputs: dict, session=None):
    """Runs on the CUDA EP (no CPU fallback) with device OrtValues bound; index inputs stay on the host.
    Returns (key, value, cache_after, scale_after) as host arrays; raises what ORT raises."""
    from kvcache_op.ort_ops import make_session

    if session is None:
        session = make_session(model, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    binding = session.io_binding()
    device_values = {}
    for info in session.get_inputs():
        array = np.asarray(inputs[info.name])
        if info.name in ("current_key", "current_value", "cache", "scale"):
            device_values[info.name] = to_device(array)
            binding.bind_ortvalue_input(info.name, device_values[info.name])
        else:
            binding.bind_cpu_input(info.name, array)
    for info in session.get_outputs():
        binding.bind_output(info.name, "cuda", 0)
    error = None
    try:
        session.run_with_iobinding(binding)
    except Exception as e:  # noqa: BLE001 - the cache is read back either way
        error = e
    cache = from_device(device_values["cache"], np.asarray(inputs["cache"]).dtype)
    scale = from_device(device_values["scale"], np.asarray(inputs["scale"]).dtype) if "scale" in device_values else None
    if error is not None:
        error.cache_after, error.scale_after = cache, scale
        raise error
    t1 = np.asarray(inputs["current_key"]).dtype
    key, value = (from_device(v, t1) for v in binding.get_outputs())
    return key, value, cache, scale


def cuda_device_count() -> int:
    """CUDA devices visible through torch or CuPy (0 when neither is installed or no device answers)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no torch, or a torch that cannot reach a driver
        pass
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0
