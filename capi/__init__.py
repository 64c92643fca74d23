"""The library's C entry points (``kvcache_op.h``: KeyValueCache, KeyCacheRotaryShift and MultiHeadAttention
on caller-allocated memory, CPU or CUDA, no ONNX Runtime needed) and their Python binding, :mod:`.c_api`
(numpy arrays, or raw pointers for torch/CuPy device memory). The C sources here are thin: they check their
arguments through the kernels' shared validation (``cpu/``) and call the kernels (``cpu/``, ``cuda/``).

The binding may import ``kvcache_op.reference`` (dtypes, errors) and ``kvcache_op.ort_ops`` (where the one
built library lies); the torch front-end and the benchmarks import it.
"""
