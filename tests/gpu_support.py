"""Device-side helpers for the GPU tests: device buffers from numpy and back through torch or CuPy
(whichever is installed), and device OrtValues for the ONNX Runtime CUDA EP tests (bfloat16 and int4 too)."""

import contextlib
import functools
import os

import numpy as np
import onnxruntime as ort

from kvcache_op.capi import c_api
from kvcache_op.reference.dtypes import INT4
from kvcache_op.reference.quantize import pack_int4, unpack_int4


def _host_bytes(array: np.ndarray) -> np.ndarray:
    if array.dtype == INT4:
        return pack_int4(array)
    return np.ascontiguousarray(array).view(np.uint8).reshape(-1)


def to_device(array: np.ndarray, device_id: int = 0) -> ort.OrtValue:
    """A CUDA OrtValue holding a copy of ``array``."""
    import cupy

    # any dtype a test binds, invalid ones too: an int16 cache must reach the op and be refused there
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), c_api.onnx_type(array.dtype), "cuda",
                                                      device_id)
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


def bind_on_cuda(session, inputs: dict, device_names) -> tuple:
    """(IOBinding, {name: device OrtValue}) of ``session``: the inputs named in ``device_names`` as device copies
    (returned, to read back what the op wrote), the others from the host; every output bound to the device."""
    binding = session.io_binding()
    device_values = {}
    for info in session.get_inputs():
        array = np.asarray(inputs[info.name])
        if info.name in device_names:
            device_values[info.name] = to_device(array)
            binding.bind_ortvalue_input(info.name, device_values[info.name])
        else:
            binding.bind_cpu_input(info.name, array)
    for info in session.get_outputs():
        binding.bind_output(info.name, "cuda", 0)
    return binding, device_values


def run_on_cuda(model, inputs: dict, session=None):
    """Runs on the CUDA EP (no CPU fallback) with device OrtValues bound; index inputs stay on the host.
    Returns (key, value, cache_after, scale_after) as host arrays; raises what ORT raises."""
    from kvcache_op.ort_ops import make_session

    if session is None:
        session = make_session(model, providers=("CUDAExecutionProvider",), disable_cpu_fallback=True)
    binding, device_values = bind_on_cuda(session, inputs, ("current_key", "current_value", "cache", "scale"))
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


@functools.lru_cache(maxsize=None)
def device_framework():
    """"torch" or "cupy": the first installed one that sees a CUDA device; None when neither does."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return "torch"
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - CuPy raises its own error type when there is no driver or device
        pass
    return None


@contextlib.contextmanager
def device_memory_full():
    """Holds (through the framework in use) all the device memory it can get, down to chunks of 1 MiB, and gives it
    back on leaving: a device allocation of more than a few MiB meanwhile fails."""
    held = []
    if device_framework() == "torch":
        import torch

        def grab(n):
            return torch.empty(n, dtype=torch.uint8, device="cuda")

        refused, release = torch.cuda.OutOfMemoryError, torch.cuda.empty_cache
        torch.cuda.synchronize()  # the runtime's stream-ordered pool gives back what it holds at a synchronization
    else:
        import cupy

        def grab(n):
            return cupy.empty(n, cupy.uint8)

        refused, release = cupy.cuda.memory.OutOfMemoryError, cupy.get_default_memory_pool().free_all_blocks
        cupy.cuda.Device().synchronize()
    chunk = 1 << 30
    try:
        while chunk >= 1 << 20:
            try:
                held.append(grab(chunk))
            except refused:
                chunk //= 2
        yield
    finally:
        held.clear()
        release()


class DeviceBuffer:
    """A device copy of a host array's bytes (int4 packed), with `guard` sentinel bytes on each side so
    a write just outside the buffer is seen; `ptr` is the address of the first data byte. The guards default to
    $KVCACHE_OP_TEST_GUARD_BYTES (4096 where unset): the compute-sanitizer steps set 0, since a read of a guard lies
    inside the allocation, where memcheck and initcheck cannot tell it from a read of the buffer."""

    SENTINEL = 0xA5

    def __init__(self, array: np.ndarray, guard: int = None, offset: int = 0):
        if guard is None:
            guard = int(os.environ.get("KVCACHE_OP_TEST_GUARD_BYTES", "4096"))
        self.dtype, self.shape = np.asarray(array).dtype, np.asarray(array).shape
        data = _host_bytes(np.asarray(array))
        self.size, self.guard, self.offset = data.size, guard, offset
        host = np.full(guard + offset + data.size + guard, self.SENTINEL, np.uint8)
        host[guard + offset:guard + offset + data.size] = data
        if device_framework() == "torch":
            import torch

            self._t = torch.from_numpy(host).cuda()
            base = self._t.data_ptr()
        else:
            import cupy

            self._t = cupy.asarray(host)
            base = self._t.data.ptr
        self.ptr = base + guard + offset

    def _host(self) -> np.ndarray:
        if device_framework() == "torch":
            return self._t.cpu().numpy()
        return self._t.get()

    def guards_intact(self) -> bool:
        host = self._host()
        lead, tail = host[:self.guard + self.offset], host[self.guard + self.offset + self.size:]
        return bool((lead == self.SENTINEL).all() and (tail == self.SENTINEL).all())

    def to_host(self) -> np.ndarray:
        raw = self._host()[self.guard + self.offset:self.guard + self.offset + self.size]
        if self.dtype == INT4:
            return unpack_int4(raw, int(np.prod(self.shape))).astype(INT4).reshape(self.shape)
        return raw.view(self.dtype).reshape(self.shape)


class Stream:
    """A non-default CUDA stream of the framework in use (`handle`: the cudaStream_t as an int)."""

    def __init__(self):
        if device_framework() == "torch":
            import torch

            self._s = torch.cuda.Stream()
            self.handle = self._s.cuda_stream
        else:
            import cupy

            self._s = cupy.cuda.Stream(non_blocking=True)
            self.handle = self._s.ptr

    def synchronize(self):
        self._s.synchronize()

    @contextlib.contextmanager
    def capturing(self):
        """The stream captured into a CUDA graph inside (the graph ended and dropped on leaving); relaxed mode, so
        only the code under test decides whether a call may be captured."""
        if device_framework() == "torch":
            import torch

            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(self._s):
                graph.capture_begin(capture_error_mode="relaxed")
                try:
                    yield
                finally:
                    graph.capture_end()
        else:
            import cupy

            self._s.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
            try:
                yield
            finally:
                self._s.end_capture()

