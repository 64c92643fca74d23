"""kvcache-op: a portable, validated opmx.dynamic_batching::KeyValueCache operator.

Subpackages: ``spec`` (schema, conformance vectors), ``reference`` (numpy semantics),
``ort_ops`` (ONNX Runtime custom-op library), ``manager`` (host-side cache manager), ``tools``.
"""

__version__ = "0.1.0"
