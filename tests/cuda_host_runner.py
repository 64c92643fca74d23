"""Builds and drives the host runner of the CUDA kernels (tests/host_runner/kv_host_runner.cc).

The runner is compiled here with the host C++ compiler from the kernels' own headers (no nvcc, no GPU),
once per source version, into the pytest cache. :func:`run` executes a call on it and returns the
results and the per-launch fault counts.
"""

import ctypes
import dataclasses
import pathlib

import numpy as np
from native_build import build_library

from kvcache_op.capi import c_api

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests/host_runner/kv_host_runner.cc", ROOT / "cpu/kv_validate.cc", ROOT / "cpu/kv_aliasing.cc",
           ROOT / "cuda/kv_cuda_params.cc", ROOT / "capi/c_tensors.cc", ROOT / "cpu/rotary_shift.cc",
           ROOT / "cuda/rotary_params.cc", ROOT / "capi/rotary_c_args.cc", ROOT / "cpu/byte_ranges.cc"]
HEADERS = [ROOT / "cuda/kv_cache_work.h", ROOT / "cuda/kv_cache_access.h", ROOT / "cuda/kv_cache_launch.h",
           ROOT / "cuda/kv_cuda_params.h", ROOT / "cpu/kv_types.h",
           ROOT / "cpu/kv_quant.h", ROOT / "cpu/kv_validate.h", ROOT / "cpu/kv_checked.h",
           ROOT / "capi/c_tensors.h", ROOT / "capi/kvcache_op.h", ROOT / "cuda/rotary_work.h",
           ROOT / "cuda/rotary_params.h", ROOT / "cpu/rotary_shift.h", ROOT / "capi/rotary_c_args.h",
           ROOT / "cpu/byte_ranges.h", ROOT / "cpu/spec_float_mode.h"]
# The spec's arithmetic, as in the library build: no contraction, no fast math.
FLAGS = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
         "-fno-fast-math", f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'cpu'}", f"-I{ROOT / 'capi'}"]

#: Totals over this test session (printed in pytest's summary by conftest.py).
CHECKED = {"launches": 0, "threads": 0, "bytes_written": 0}

BUFFERS = ("seqstarts", "kvstarts", "start_pos", "cachestarts", "current_key", "current_value", "cache", "scale",
           "out_key", "out_value", "slots", "cos", "sin")


class Options(ctypes.Structure):
    _fields_ = [("store_unit", ctypes.c_int64), ("gather_unit", ctypes.c_int64),
                ("buffer_bytes", ctypes.c_int64 * len(BUFFERS))]


class Report(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("launches", "blocks", "threads", "bytes_read", "bytes_written",
                                                    "out_of_bounds", "misaligned", "write_write", "read_write")]

    def faults(self) -> int:
        return self.out_of_bounds + self.misaligned + self.write_write + self.read_write


def build(cache_dir: pathlib.Path) -> pathlib.Path:
    """The runner library, compiled into ``cache_dir`` unless a build of the same sources is there."""
    return build_library("kv_host_runner", SOURCES, HEADERS, FLAGS, cache_dir)


@dataclasses.dataclass
class Result:
    code: int
    message: str
    report: Report
    key: np.ndarray | None
    value: np.ndarray | None


class HostRunner:
    """The loaded runner."""

    def __init__(self, path: pathlib.Path):
        self.lib = ctypes.CDLL(str(path))
        fn = self.lib.kv_host_run
        fn.argtypes = [ctypes.POINTER(c_api.CKeyValueCacheAttrs), ctypes.POINTER(c_api.CTensor),
                       ctypes.POINTER(c_api.CTensor), ctypes.POINTER(Options), ctypes.POINTER(Report),
                       ctypes.c_char_p, ctypes.c_size_t]
        fn.restype = ctypes.c_int32
        rotary = self.lib.rotary_host_run
        rotary.argtypes = [ctypes.POINTER(c_api.CRotaryShiftAttrs), ctypes.POINTER(c_api.CTensor),
                           ctypes.POINTER(Options), ctypes.POINTER(Report), ctypes.c_char_p, ctypes.c_size_t]
        rotary.restype = ctypes.c_int32

    def run(self, inputs: dict, attributes: dict, *, store_unit=0, gather_unit=0, buffer_bytes=None,
            tensors=None) -> Result:
        """Runs the kernels' threads on ``inputs`` (numpy, the reference's names; the cache and scale are
        written in place, int4 ones too). ``tensors`` replaces chosen inputs/outputs by raw
        :class:`c_api.Tensor` s (by name: an input's, ``out_key`` or ``out_value``)."""
        tensors = tensors or {}
        buffers = c_api.HostBuffers()
        c_in = [tensors.get(name) or buffers.tensor(name, inputs.get(name), written=name in ("cache", "scale"))
                for name in c_api.KV_INPUTS]
        attrs = c_api.key_value_cache_attributes(**attributes)
        shape, dtype, outs = None, np.asarray(inputs["current_key"]).dtype, (None, None)
        try:
            shape = c_api.output_shape(c_in, **{k: attributes[k] for k in attributes if k in c_api.KV_ATTRIBUTES})
        except ValueError:
            pass  # the runner reports the same validation error below
        if shape is not None:
            outs = (np.zeros(shape, dtype), np.zeros(shape, dtype))
        c_out = [tensors.get(name) or (c_api.Tensor(c_api.ONNX_TYPES[dtype], shape, out.ctypes.data)
                                       if out is not None else c_api.ABSENT)
                 for name, out in zip(("out_key", "out_value"), outs)]
        options = Options(store_unit, gather_unit)
        for i, name in enumerate(BUFFERS):
            options.buffer_bytes[i] = (buffer_bytes or {}).get(name, -1)
        report, message = Report(), ctypes.create_string_buffer(8192)
        code = self.lib.kv_host_run(ctypes.byref(attrs), c_api.c_array(c_in, 10, "inputs"),
                                    c_api.c_array(c_out, 2, "outputs"), ctypes.byref(options), ctypes.byref(report),
                                    message, len(message))
        return self._finish(code, buffers, report, message, outs)

    @staticmethod
    def _finish(code, buffers, report, message, outs) -> Result:
        if code in (0, 4):
            buffers.finish()
        if code == 0:
            CHECKED["launches"] += report.launches
            CHECKED["threads"] += report.threads
            CHECKED["bytes_written"] += report.bytes_written
        return Result(code, message.value.decode(), report, *outs)

    def run_rotary(self, inputs: dict, attributes: dict, *, buffer_bytes=None) -> Result:
        """Runs the KeyCacheRotaryShift kernel's threads on ``inputs`` (numpy: cache, scale, slots, cos,
        sin; the cache and scale are written in place, int4 ones too)."""
        buffers = c_api.HostBuffers()
        c_in = [buffers.tensor(name, inputs.get(name), written=name in ("cache", "scale"))
                for name in ("cache", "scale", "slots", "cos", "sin")]
        attrs = c_api.rotary_shift_attributes(**attributes)
        options = Options(0, 0)
        for i, name in enumerate(BUFFERS):
            options.buffer_bytes[i] = (buffer_bytes or {}).get(name, -1)
        report, message = Report(), ctypes.create_string_buffer(8192)
        code = self.lib.rotary_host_run(ctypes.byref(attrs), c_api.c_array(c_in, 5, "inputs"), ctypes.byref(options),
                                        ctypes.byref(report), message, len(message))
        return self._finish(code, buffers, report, message, (None, None))


def assert_clean(result: Result) -> None:
    assert result.code == 0, f"host runner: code {result.code}\n{result.message}"
    assert result.report.faults() == 0
