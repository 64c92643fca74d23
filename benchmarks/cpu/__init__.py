"""KeyValueCache on the ONNX Runtime CPU EP against a plain copy of the same bytes, the numpy reference and
the same step from ONNX Runtime's built-in ops (``bench``, ``standard_ops``); ``bound/``: the memory-traffic
bound and profiling helpers."""
