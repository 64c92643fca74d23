"""torch tensors described to the library's C entry points (:class:`kvcache_op.capi.c_api.Tensor`).

How torch holds what the ops take:

* float32 / float16 / bfloat16 / int8 / int64 tensors are passed as they are (no copy when contiguous).
* **int4** caches have no torch dtype: a ``quant_bit=4`` cache is a ``torch.uint8`` tensor holding ONNX's
  INT4 packing — the cache's logical shape with the last axis halved (``Dh / 2`` bytes per row), element
  ``2i`` in the low nibble of byte ``i``, two's complement. The library is handed the bytes as INT4 with
  the logical shape, so nothing is copied. :func:`kvcache_op.torch.pack_int4` /
  :func:`~kvcache_op.torch.unpack_int4` convert codes.
"""

from __future__ import annotations

import contextlib

import torch

from ..capi.c_api import ABSENT, Tensor
from ..reference.validate import KeyValueCacheError

#: ONNX element type of each torch dtype (the library names the ones an op refuses in its message).
ONNX_TYPES = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.uint16: 4, torch.int16: 5, torch.int32: 6,
              torch.int64: 7, torch.bool: 9, torch.float16: 10, torch.float64: 11, torch.uint32: 12,
              torch.uint64: 13, torch.bfloat16: 16}
ONNX_INT4 = 22
DATA_DEVICES = ("cpu", "cuda")


def onnx_type(dtype: torch.dtype) -> int:
    """The ONNX element type of a torch dtype; ``KeyValueCacheError`` for one ONNX has no type for."""
    try:
        return ONNX_TYPES[dtype]
    except KeyError:
        raise KeyValueCacheError(f"dtype {dtype} has no ONNX element type the ops take") from None


def describe(tensor: torch.Tensor | None) -> Tensor:
    """A read-only input as a C description (``ABSENT`` for ``None``); the tensor must be contiguous and
    stay alive until the call returns."""
    if tensor is None:
        return ABSENT
    return Tensor(onnx_type(tensor.dtype), tuple(tensor.shape), tensor.data_ptr())


def refuse_not_dense(name: str, tensor: torch.Tensor, error=KeyValueCacheError) -> None:
    """``error`` naming ``tensor`` unless it is dense (strided): a sparse or mkldnn one has no memory of its elements
    to hand over (``data_ptr`` fails)."""
    if tensor.layout != torch.strided:
        raise error(f"{name} must be a dense (strided) tensor, got a {tensor.layout} one")


def refuse_unwritable(name: str, tensor: torch.Tensor, error=KeyValueCacheError) -> None:
    """``error`` where torch forbids or defeats an in-place write to ``tensor``: a lazily negated or conjugated view,
    or an inference tensor outside inference mode. Checked by the ops' Python API and again by their kernels (under
    ``torch.compile`` and through ``torch.ops.kvcache_op`` only the kernels see real tensors), before any write."""
    if tensor.is_neg() or tensor.is_conj():
        # A lazy view's memory does not hold the values it reads as; torch's fallback for it copies, and the
        # op's in-place write then failed torch's internal assert
        raise error(f"{name} is a lazily negated or conjugated view (torch._neg_view, .conj()): the op writes "
                    f"its memory in place; pass a resolved tensor ({name}.resolve_neg().resolve_conj())")
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise error(f"{name} is an inference tensor, which torch lets no in-place write change outside "
                    f"torch.inference_mode(): call the op inside it, or make {name} outside it")


def _writable(name: str, tensor: torch.Tensor) -> None:
    """A tensor the kernels write in place: contiguous (not a view the write could miss), not one autograd tracks (the
    writes are invisible to it: torch refuses an in-place write to a leaf that requires grad, and one to a graph's
    tensor would give wrong gradients), and one torch lets be written (:func:`refuse_unwritable`)."""
    refuse_unwritable(name, tensor)
    if not tensor.is_contiguous():
        raise KeyValueCacheError(f"{name} must be contiguous: the op writes it in place")
    if tensor.requires_grad:
        raise KeyValueCacheError(f"{name} requires grad, and the op writes it in place, which autograd cannot "
                                 f"track: pass {name}.detach() (the same memory) or a tensor made without grad")


def _extent(tensor: torch.Tensor):
    """(device, first byte, end byte) of the memory ``tensor``'s elements span; None when it has none."""
    if tensor.numel() == 0:
        return None
    span = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
    start = tensor.data_ptr()
    return tensor.device, start, start + span * tensor.element_size()


def refuse_overlaps(rules, **tensors) -> None:
    """Refuses (``KeyValueCacheError``), for each ``(written, others)`` of ``rules`` (the C entry points' pairs,
    ``c_api.KV_APART``...), ``written`` spanning memory that one of ``others`` spans, before any input is copied:
    the C entry points check the buffers they are handed, and a strided input is handed over as a contiguous copy,
    which would hide its overlap (the numpy binding's check, ``np.may_share_memory``, is by extent too)."""
    for written, others in rules:
        target = tensors.get(written)
        extent = None if target is None else _extent(target)
        for name in () if extent is None else others:
            other = None if tensors.get(name) is None else _extent(tensors[name])
            if other is not None and other[0] == extent[0] and other[1] < extent[2] and extent[1] < other[2]:
                raise KeyValueCacheError(f"{written} overlaps {name}: the op writes {written} while it reads or "
                                         f"writes {name}, so they must not share memory")


def describe_cache(name: str, cache: torch.Tensor, quant_bit: int) -> Tensor:
    """A cache (written in place: see :func:`_writable`) as a C description; a ``quant_bit=4`` cache must be the
    packed ``uint8`` form and is handed over as INT4."""
    _writable(name, cache)
    if quant_bit == 4:
        if cache.dtype != torch.uint8:
            raise KeyValueCacheError(
                f"{name} must be a torch.uint8 tensor of packed int4 pairs for quant_bit=4 (the cache shape with "
                f"last dim Dh/2, ONNX INT4 packing: kvcache_op.torch.pack_int4), got {cache.dtype}")
        if cache.dim() == 0:
            raise KeyValueCacheError(f"{name} must have rank 5, got shape ()")
        logical = tuple(cache.shape[:-1]) + (2 * cache.shape[-1],)
        if logical[-1] >= 2**63:
            raise KeyValueCacheError(f"{name}'s int4 last dim 2 * {cache.shape[-1]} does not fit in int64")
        return Tensor(ONNX_INT4, logical, cache.data_ptr())
    return describe(cache)


def describe_written(name: str, tensor: torch.Tensor | None) -> Tensor:
    """A tensor the op writes in place (the scale; see :func:`_writable`), described as it is."""
    if tensor is not None:
        _writable(name, tensor)
    return describe(tensor)


def on_host(name: str, value) -> torch.Tensor:
    """An input the kernels read on the host (index inputs; the rotation tables) as a contiguous CPU
    tensor: ints become int64 tensors; a CUDA tensor is copied to the host (the op needs index values
    on the host to validate a call before launching it)."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, int):
            raise KeyValueCacheError(f"{name} must be a torch.Tensor or an int, got {type(value).__name__}")
        return torch.tensor(value, dtype=torch.int64)
    refuse_not_dense(name, value)
    return value.detach().to("cpu").contiguous()


def data_device(**tensors) -> torch.device:
    """The one device of the data tensors (``None`` entries skipped); ``KeyValueCacheError`` when they
    differ or the device is neither CPU nor CUDA, or naming one that is not dense (sparse, mkldnn: no memory of its
    elements to hand over; checked first, as every kernel calls this before anything else)."""
    for name, t in tensors.items():
        if t is not None:
            refuse_not_dense(name, t)
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    distinct = set(devices.values())
    if len(distinct) != 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise KeyValueCacheError(f"the data tensors must be on one device, got {listing}")
    device = distinct.pop()
    if device.type not in DATA_DEVICES:
        raise KeyValueCacheError(f"the ops run on CPU and CUDA tensors, got {device}")
    return device


@contextlib.contextmanager
def int4_shapes_explained(quant_bit: int):
    """The library reports an int4 cache's logical shape; say so, since torch holds it packed."""
    try:
        yield
    except KeyValueCacheError as error:
        if quant_bit == 4 and "cache shape must be" in str(error):
            raise KeyValueCacheError(f"{error} (shapes of the unpacked int4 cache: torch holds it as uint8 with the "
                                     "last dim halved)") from None
        raise
