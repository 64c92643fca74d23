"""Builds and drives the host runner of the attention CUDA kernels (tests/host_runner/attention_host_runner.cc).

The runner is compiled with the host C++ compiler from the kernels' own headers (no nvcc, no GPU), once per
source version. :meth:`AttentionHostRunner.run` executes a MultiHeadAttention or MultiHeadCacheAttention call
through every block of the kernels' launches and returns the output with the runner's fault counts.
"""

import ctypes
import dataclasses
import pathlib

import numpy as np
from native_build import build_library

from kvcache_op.capi import c_api

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "tests/host_runner/attention_host_runner.cc", ROOT / "cpu/kv_validate.cc", ROOT / "cpu/kv_aliasing.cc",
           ROOT / "cpu/mha_validate.cc", ROOT / "cpu/mhca_validate.cc", ROOT / "cuda/kv_cuda_params.cc",
           ROOT / "cuda/attention_params.cc", ROOT / "capi/c_tensors.cc", ROOT / "capi/attention_c_args.cc",
           ROOT / "cpu/byte_ranges.cc"]
# Every header the runner could include: a build is reused only when none of them changed (a list by hand went
# stale once, and a stale build tests old kernel code).
HEADERS = sorted(path for folder in ("cuda", "cpu", "capi") for path in (ROOT / folder).glob("*.h"))
FLAGS = ["-std=c++17", "-O1", "-g", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off",
         "-fno-fast-math", f"-I{ROOT / 'cuda'}", f"-I{ROOT / 'cpu'}", f"-I{ROOT / 'capi'}"]

#: Totals over this test session (printed in pytest's summary by conftest.py).
CHECKED = {"launches": 0, "blocks": 0, "split_tiles": 0}


#: The launch's buffers, in the kernels' order (cuda/attention_launch.h, ABuf).
BUFFERS = ("query", "key", "value", "cache", "scale", "attn_mask", "output", "index", "tiles", "partials", "shared")


class Options(ctypes.Structure):
    _fields_ = [("min_blocks", ctypes.c_int64), ("min_split_keys", ctypes.c_int64), ("skip_sync", ctypes.c_int64),
                ("buffer_bytes", ctypes.c_int64 * len(BUFFERS)), ("tile_kernel_only", ctypes.c_int64),
                ("mma_decode", ctypes.c_int64), ("mma_form", ctypes.c_int64), ("decode_form", ctypes.c_int64),
                ("short_wait", ctypes.c_int64)]


class Report(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "launches", "blocks", "threads", "tiles", "merges", "split_tiles", "out_of_bounds", "misaligned",
        "write_write", "read_write", "uninitialized", "decode_tiles", "mma_tiles", "mma_form", "decode_form",
        "divergent", "index_words", "store_index_words")]

    def faults(self) -> int:
        return (self.out_of_bounds + self.misaligned + self.write_write + self.read_write + self.uninitialized
                + self.divergent)


@dataclasses.dataclass
class Result:
    code: int
    message: str
    report: Report
    output: np.ndarray | None


def build(cache_dir: pathlib.Path) -> pathlib.Path:
    """The runner library, compiled into ``cache_dir`` unless a build of the same sources is there."""
    return build_library("attention_host_runner", SOURCES, HEADERS, FLAGS, cache_dir)


class AttentionHostRunner:
    """The loaded runner."""

    def __init__(self, path: pathlib.Path):
        self.lib = ctypes.CDLL(str(path))
        common = [ctypes.POINTER(c_api.CTensor), ctypes.POINTER(c_api.CTensor), ctypes.POINTER(Options),
                  ctypes.POINTER(Report), ctypes.c_char_p, ctypes.c_size_t]
        self.lib.mha_host_run.argtypes = [ctypes.POINTER(c_api.CMultiHeadAttentionAttrs)] + common
        self.lib.mhca_host_run.argtypes = [ctypes.POINTER(c_api.CMultiHeadCacheAttentionAttrs)] + common
        self.lib.mha_host_run.restype = self.lib.mhca_host_run.restype = ctypes.c_int32
        self.lib.attn_host_team_misuse.argtypes = [ctypes.c_int64]
        self.lib.attn_host_team_misuse.restype = ctypes.c_int64

    def run(self, inputs: dict, attributes: dict, *, min_blocks=0, min_split_keys=0, skip_sync=False,
            views=None, buffer_bytes=None, tile_kernel_only=False, mma_decode=False, mma_form=1, decode_form=1,
            short_wait=0) -> Result:
        """Runs the call (MultiHeadCacheAttention when ``inputs`` has a cache, else MultiHeadAttention; the cache
        and scale are written in place). ``views``: names of inputs passed 2 bytes past their array's start (a
        misaligned copy, written back after the call), so the kernels take their element-by-element path; not for int4
        arrays. ``buffer_bytes``: {buffer name: size the checks assume} (smaller than the real one: an access past
        it must be flagged). ``tile_kernel_only``: every tile goes to the tile kernel (sequences of one token not to
        the decode kernel, float16 / bfloat16 prefills not to the tensor-core kernel). ``mma_decode``: sequences of one
        token go to the tensor-core kernel too (where it takes the call). ``mma_form``: that kernel's form, 1 (products
        through shared memory) or 2 (in registers). ``decode_form``: the decode kernel's, 1 (reads in registers), 2
        (rows staged in shared memory, where the rows are float16 / bfloat16 as stored and 16-byte aligned; else 1) or 3
        (the same, every head of a tile in a thread's registers).
        ``short_wait``: a wait for asynchronous copies leaves that many more groups in flight than the kernel asks
        (reads of copies not yet made must be flagged)."""
        cache = "cache" in inputs
        names = c_api.MHCA_INPUTS if cache else c_api.MHA_INPUTS
        buffers, views_back = c_api.HostBuffers(), []
        tensors = []
        for name in names:
            value = inputs.get(name)
            if value is not None and name in (views or ()):
                array = np.asarray(value)
                raw = np.zeros(array.nbytes + 16, np.uint8)
                raw[2:2 + array.nbytes] = array.view(np.uint8).reshape(-1)
                views_back.append((value, raw))  # kept alive, and written back (the cache and scale)
                tensors.append(c_api.Tensor(c_api.onnx_type(array.dtype), array.shape, raw.ctypes.data + 2))
                continue
            tensors.append(buffers.tensor(name, value, written=name in ("cache", "scale")))
        query = np.asarray(inputs["query"])
        out = np.full(query.shape, np.nan, query.dtype)  # poisoned: every element must be written
        output = c_api.Tensor(c_api.onnx_type(query.dtype), query.shape, out.ctypes.data)
        if cache:
            attrs = c_api.multi_head_cache_attention_attributes(**attributes)
            fn = self.lib.mhca_host_run
        else:
            attrs = c_api.multi_head_attention_attributes(**attributes)
            fn = self.lib.mha_host_run
        report, message = Report(), ctypes.create_string_buffer(8192)
        options = Options(min_blocks, min_split_keys, int(skip_sync))
        options.tile_kernel_only = int(tile_kernel_only)
        options.mma_decode = int(mma_decode)
        options.mma_form = int(mma_form)
        options.decode_form = int(decode_form)
        options.short_wait = int(short_wait)
        for i, name in enumerate(BUFFERS):
            options.buffer_bytes[i] = (buffer_bytes or {}).get(name, -1)
        code = fn(ctypes.byref(attrs), c_api.c_array(tensors, len(names), "inputs"), ctypes.byref(output.to_c()),
                  ctypes.byref(options),
                  ctypes.byref(report), message, len(message))
        if code in (0, 4):
            buffers.finish()
            for array, raw in views_back:
                if isinstance(array, np.ndarray) and array.flags.writeable:
                    array.view(np.uint8).reshape(-1)[...] = raw[2:2 + array.nbytes]
        if code == 0:
            CHECKED["launches"] += report.launches
            CHECKED["blocks"] += report.blocks
            CHECKED["split_tiles"] += report.split_tiles
        return Result(code, message.value.decode(), report, out if code in (0, 4) else None)

    #: The block-wide operations of the kernels' team, in the runner's order (TeamMisuse).
    TEAM_OPERATIONS = ("Each", "Sync", "Commit", "WaitSync", "Butterfly", "SyncOr", "Mma", "LoadMatrix", "MatMul")

    def team_misuse(self, operation: str | None) -> int:
        """How many calls the runner flags when every thread calls ``operation`` inside its part of a phase
        (team.Each); with None, every operation called as the kernels call them, outside team.Each."""
        return self.lib.attn_host_team_misuse(0 if operation is None else 1 + self.TEAM_OPERATIONS.index(operation))


def assert_clean(result: Result) -> None:
    assert result.code == 0, f"attention host runner: code {result.code}\n{result.message}"
    assert result.report.faults() == 0
