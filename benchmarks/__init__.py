"""Benchmarks, each folder its code beside its results (``python -m kvcache_op.benchmarks.<name>.<module>``;
``kvcache-op bench op|attention|manager`` runs the first three): ``cpu/`` (KeyValueCache on the CPU EP),
``gpu/`` (the CUDA kernels), ``attention/`` (MultiHeadAttention), ``manager/`` (the cache manager's cost per
step), ``serving/`` (the engine end to end), ``shift_error/`` (shift-RoPE-K's error).

Shared here: ``timing`` (medians of repeats, the machine in words), ``bound_session`` (ONNX Runtime calls
with inputs and outputs bound once), ``kv_shapes`` (the KeyValueCache cases both op benchmarks measure) and
``chart``. Benchmarks may import every other part of the package; nothing imports them but the command line.
"""
