"""kvcache-op: a portable, validated opmx.dynamic_batching::KeyValueCache operator.

Subpackages, in the order data flows (each imports only those before it): ``spec`` (schemas),
``reference`` (numpy semantics), ``ort_ops`` (ONNX Runtime custom ops, the library), ``capi`` (the C entry
points' binding), ``validation`` (the backend validation kit), ``manager`` (host-side cache manager),
``serving`` (the engine), ``torch`` and ``hf`` (front-ends), ``benchmarks``. ``cli`` is the command line.
"""

__version__ = "0.1.0"
