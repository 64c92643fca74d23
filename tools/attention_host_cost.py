"""The host side of MultiHeadCacheAttention on CUDA, timed on the CPU (no GPU needed): per call, the validation, the
attention's plan (its tiles and merges) and the stores' index words appended to it, as the CUDA path does them
before it enqueues anything, for the GPU attention benchmark's shapes (float16, pages of 16 slots). On a GPU the call
adds the one copy of those words to the device and the launches (the GPU attention benchmark's "host ms").

    python tools/attention_host_cost.py            # from a checkout, with kvcache_op installed

Builds tools/attention_host_cost.cc with the planner's sources (c++, -O3 as the library's release build) into a
temporary folder. Medians of 7 rounds, each the mean of its calls.
"""

import ctypes
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from kvcache_op.benchmarks.gpu.attention import Case, index_arrays
from kvcache_op.capi import c_api
from kvcache_op.reference import cache_shape

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ["tools/attention_host_cost.cc", "cpu/kv_validate.cc", "cpu/kv_aliasing.cc", "cpu/mha_validate.cc",
           "cpu/mhca_validate.cc", "cpu/byte_ranges.cc", "cuda/kv_cuda_params.cc", "cuda/attention_params.cc",
           "capi/c_tensors.cc", "capi/attention_c_args.cc"]
#: (name, batch, query rows per sequence, keys per sequence, heads, kv heads, layout, tensor-core kernel)
SHAPES = [("decode B=64 kvlen=1024 8/2 heads", 64, 1, 1024, 8, 2, 0, False),
          ("decode B=64 kvlen=1024 8/2 heads, layout 3", 64, 1, 1024, 8, 2, 3, False),
          ("decode B=32 kvlen=2048 32/8 heads", 32, 1, 2048, 32, 8, 0, False),
          ("prefill B=8 S=1024 32/8 heads, tensor-core tiles", 8, 1024, 1024, 32, 8, 0, True),
          ("prefill B=8 S=1024 32/8 heads, tile-kernel tiles (float32's route)", 8, 1024, 1024, 32, 8, 0, False)]


def build(folder: pathlib.Path) -> ctypes.CDLL:
    """The timing library, compiled from this checkout."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ / g++ / $CXX) to build the timing library")
    target = folder / "attention_host_cost.so"
    flags = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"]
    flags += [f"-I{ROOT / d}" for d in ("cuda", "cpu", "capi")]
    subprocess.run([cxx, *flags, *(str(ROOT / s) for s in SOURCES), "-o", str(target)], check=True)
    lib = ctypes.CDLL(str(target))
    lib.attention_host_cost.argtypes = [ctypes.POINTER(c_api.CMultiHeadCacheAttentionAttrs),
                                        ctypes.POINTER(c_api.CTensor), ctypes.POINTER(c_api.CTensor), ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    return lib


def measure(lib: ctypes.CDLL, batch, rows, keys, heads, kv_heads, layout, mma) -> list:
    """[validate, index words, plan] in microseconds, the plan's words, its tiles: the GPU attention benchmark's
    float16 MultiHeadCacheAttention call of these sizes (head_dim 128, pages of 16 slots), zero-filled."""
    case = Case("mhca", "decode" if rows == 1 else "prefill", batch, rows, keys, heads, kv_heads, layout=layout)
    index, slots = index_arrays(case, np.random.default_rng(0))
    query = np.zeros((batch * rows, heads, case.head_dim), np.float16)
    current = np.zeros((batch * rows, kv_heads, case.head_dim), np.float16)
    arrays = dict(index, query=query, current_key=current, current_value=current, scale=None, attn_mask=None,
                  cache=np.zeros(cache_shape(layout, 1, slots, kv_heads, case.head_dim), np.float16))
    host = c_api.HostBuffers()
    inputs = [host.tensor(name, arrays[name]) for name in c_api.MHCA_INPUTS]
    output = host.tensor("output", np.zeros_like(query))
    attrs = c_api.multi_head_cache_attention_attributes(
        num_heads=heads, head_dim=case.head_dim, num_kv_heads=kv_heads, is_causal=1, quant_bit=0, cache_mode=1,
        cache_layout=layout, page_size=case.page_size)
    out = (ctypes.c_double * 5)()
    calls = 20 if rows > 1 else 200
    if lib.attention_host_cost(ctypes.byref(attrs), c_api.c_array(inputs, 13, "inputs"), ctypes.byref(output.to_c()),
                               int(mma), 7,
                               calls, out) != 0:
        raise RuntimeError("the call was refused")
    return [x / 1e3 for x in out[:3]] + [int(out[3]), int(out[4])]


def main() -> int:
    with tempfile.TemporaryDirectory() as folder:
        lib = build(pathlib.Path(folder))
        print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; one thread; microseconds "
              "per call, medians of 7 rounds\n")
        print("| shape | validate | index words | plan | plan's words | tiles |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for name, *shape in SHAPES:
            v, k, planned, words, tiles = measure(lib, *shape)
            print(f"| {name} | {v:.1f} | {k:.1f} | {planned:.1f} | {words} | {tiles} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
