"""PyTorch front-end: the ops on torch tensors, traced by ``torch.compile``/``torch.export``, and exported
by ``torch.onnx.export`` (``dynamo=True`` or ``False``) as ``opmx.dynamic_batching`` nodes.

Install with ``pip install "kvcache-op[torch]"``. Importing this module registers the custom ops
``torch.ops.kvcache_op.key_value_cache`` / ``key_cache_rotary_shift`` / ``multi_head_attention`` /
``multi_head_cache_attention`` and
their TorchScript-exporter translations.

* :func:`key_value_cache`, :func:`key_cache_rotary_shift`: the reference's signatures; the cache and
  scale are written in place (one that requires grad is refused: autograd cannot see the writes).
  :func:`multi_head_attention`: the companion varlen attention; :func:`multi_head_cache_attention`: the two
  fused, reading the cache in place. CPU tensors run the library's C++ kernels, CUDA tensors its CUDA kernels.
* int4 caches are ``torch.uint8`` tensors of packed pairs (the cache shape with last dim ``Dh / 2``,
  ONNX INT4 packing): :func:`pack_int4`, :func:`unpack_int4`, :func:`new_cache`.
* :func:`int4_cache_inputs` retypes an exported graph's uint8 cache inputs to INT4; :func:`export_onnx`
  exports, applies it, checks the model and saves it in one call.

It may import ``kvcache_op.capi`` (the kernels it runs), ``kvcache_op.ort_ops`` (the graph rules its export
checks), ``kvcache_op.spec`` and ``kvcache_op.reference``.
"""

try:
    import torch  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError("kvcache_op.torch needs PyTorch: pip install \"kvcache-op[torch]\" (torch==2.13.0)") from error

from .cache import new_cache, pack_int4, unpack_int4
from .export import export_onnx
from .functional import key_cache_rotary_shift, key_value_cache, multi_head_attention, multi_head_cache_attention
from .onnx_export import int4_cache_inputs, register_torchscript_symbolics

register_torchscript_symbolics()

__all__ = ["export_onnx", "int4_cache_inputs", "key_cache_rotary_shift", "key_value_cache", "multi_head_attention",
           "multi_head_cache_attention", "new_cache", "pack_int4", "unpack_int4"]
