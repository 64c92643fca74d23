"""Python binding of the library's framework-neutral C entry points (``capi/kvcache_op.h``).

Two levels:

* :func:`key_value_cache` / :func:`key_cache_rotary_shift`: numpy in, numpy out, the reference's
  signature; run the CPU kernels through ``kvcache_op_*_cpu``. The cache (and scale) are written in place.
* :func:`run_key_value_cache` / :func:`run_key_cache_rotary_shift`: raw pointers (:class:`Tensor` descriptions) on ``"cpu"`` or ``"cuda"``,
  for callers that own device memory (torch, CuPy): index inputs are host numpy arrays, everything else
  is described by a pointer, a type and a shape.

* :func:`multi_head_attention` (numpy, the reference's signature) and :func:`run_multi_head_attention`
  (raw host pointers, the shape of :func:`run_key_value_cache`): MultiHeadAttention's CPU kernel.

Invalid calls raise :class:`kvcache_op.reference.KeyValueCacheError` (a ``ValueError``;
:class:`~kvcache_op.reference.MultiHeadAttentionError` for MultiHeadAttention) with the same message the
reference gives, and leave the cache, scale and outputs unchanged; the binding's own checks (attributes that
are not integers, arrays the C entry points cannot take, copied arrays sharing memory with written ones) say so
in their words. MultiHeadCacheAttention's errors are all ``KeyValueCacheError``: the C entry point does not tell
the attention's rules apart, where the reference raises its subclass. CUDA or allocation failures raise
``RuntimeError``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import operator

import numpy as np

from ..reference.dtypes import BFLOAT16, INT4
from ..reference.quantize import pack_int4, unpack_int4
from ..reference.mha_validate import MultiHeadAttentionError
from ..reference.validate import KeyValueCacheError, effective_scale

C_API_VERSION = 12
MAX_RANK = 8
OK, INVALID_ARGUMENT, RUNTIME_ERROR, UNAVAILABLE = 0, 1, 2, 3

#: ONNX element type of each numpy dtype the ops take.
ONNX_TYPES = {np.dtype(np.float32): 1, np.dtype(np.int8): 3, np.dtype(np.int64): 7, np.dtype(np.float16): 10,
              BFLOAT16: 16, INT4: 22}

KV_INPUTS = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
             "max_kvlen", "cache", "scale")
KV_INDEX_INPUTS = KV_INPUTS[2:8]
KV_ATTRIBUTES = ("num_layer", "layer_idx", "quant_bit", "quant_group", "num_repeat", "cache_mode", "cache_layout",
                 "page_size")
MHA_INPUTS = ("query", "key", "value", "seqstarts", "kvstarts", "decoding_batches", "max_seqlen", "max_kvlen",
              "attn_mask")
MHA_INT_ATTRIBUTES = ("num_heads", "head_dim", "is_causal", "is_alibi", "num_kv_heads", "sliding_window")
MHA_ATTRIBUTES = MHA_INT_ATTRIBUTES + ("softmax_scale", "softcap")
MHCA_INPUTS = ("query", "current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos",
               "decoding_batches", "max_seqlen", "max_kvlen", "cache", "scale", "attn_mask")
MHCA_INT_ATTRIBUTES = ("num_layer", "layer_idx", "quant_bit", "quant_group", "cache_mode", "cache_layout",
                       "page_size") + MHA_INT_ATTRIBUTES
MHCA_ATTRIBUTES = MHCA_INT_ATTRIBUTES + ("softmax_scale", "softcap")
ROTARY_ATTRIBUTES = ("num_layer", "layer_idx", "quant_bit", "quant_group", "cache_layout", "rotary_dim",
                     "rotary_interleaved")
#: Each op's written buffers and the data inputs each must not share memory with (the C entry points' pairs:
#: cpu/byte_ranges.cc, cpu/rotary_shift.cc, cpu/mhca_validate.cc), for the arrays the binding passes as copies.
KV_APART = (("cache", ("current_key", "current_value")), ("scale", ("current_key", "current_value", "cache")))
ROTARY_APART = (("scale", ("cache",)),)
MHCA_APART = (("cache", ("query", "current_key", "current_value", "attn_mask")),
              ("scale", ("query", "current_key", "current_value", "cache", "attn_mask")))


def onnx_type(dtype) -> int:
    """The ONNX element type of a numpy dtype (any dtype ONNX has: the library's validation names the
    types it refuses, with the reference's message)."""
    from onnx.helper import np_dtype_to_tensor_dtype

    try:
        return ONNX_TYPES.get(np.dtype(dtype)) or int(np_dtype_to_tensor_dtype(np.dtype(dtype)))
    except (KeyError, TypeError, ValueError) as error:
        raise KeyValueCacheError(f"dtype {np.dtype(dtype)} has no ONNX element type") from error


class CTensor(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("rank", ctypes.c_int32), ("shape", ctypes.c_int64 * MAX_RANK),
                ("data", ctypes.c_void_p)]


class CKeyValueCacheAttrs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in KV_ATTRIBUTES]


class CRotaryShiftAttrs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ROTARY_ATTRIBUTES]


class CMultiHeadAttentionAttrs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in MHA_INT_ATTRIBUTES] + [("softmax_scale", ctypes.c_float),
                                                                      ("softcap", ctypes.c_float)]


class CMultiHeadCacheAttentionAttrs(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in MHCA_INT_ATTRIBUTES] +
                [("softmax_scale", ctypes.c_float), ("softcap", ctypes.c_float)])


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A dense C-contiguous tensor at ``data`` (a host or device address): ONNX ``type`` and ``shape``.
    ``type == 0`` marks an absent optional input."""

    type: int
    shape: tuple
    data: int

    def to_c(self) -> CTensor:
        if len(self.shape) > MAX_RANK:
            raise KeyValueCacheError(f"rank {len(self.shape)} exceeds the C entry points' {MAX_RANK}")
        c = CTensor(self.type, len(self.shape))
        for i, d in enumerate(self.shape):
            c.shape[i] = int(d)
        c.data = self.data or None
        return c


ABSENT = Tensor(0, (), 0)


@functools.lru_cache(maxsize=None)
def library(path: str | None = None) -> ctypes.CDLL:
    """The loaded library (default: :func:`kvcache_op.ort_ops.library_path`), with argument types set;
    ``RuntimeError`` when its C API version differs from this binding's."""
    if path is None:
        from ..ort_ops import library_path

        path = library_path()
    lib = ctypes.CDLL(path)
    message = (ctypes.c_char_p, ctypes.c_size_t)
    kv_attrs, rot_attrs = ctypes.POINTER(CKeyValueCacheAttrs), ctypes.POINTER(CRotaryShiftAttrs)
    mha_attrs = ctypes.POINTER(CMultiHeadAttentionAttrs)
    mhca_attrs = ctypes.POINTER(CMultiHeadCacheAttentionAttrs)
    tensors = ctypes.POINTER(CTensor)
    signatures = {
        "kvcache_op_c_api_version": ((), ctypes.c_int32),
        "kvcache_op_has_cuda": ((), ctypes.c_int32),
        "kvcache_op_cpu_kernel": ((), ctypes.c_char_p),
        "kvcache_op_cpu_stores": ((), ctypes.c_char_p),
        "kvcache_op_cpu_cached_gather": ((), ctypes.c_char_p),
        "kvcache_op_cpu_streamed_heads": ((ctypes.c_int64,), ctypes.c_int64),
        "kvcache_op_cpu_gather_tile_bytes": ((ctypes.c_int64, ctypes.c_int64), ctypes.c_int64),
        "kvcache_op_cpu_code_stores": ((), ctypes.c_char_p),
        "kvcache_op_cpu_token_streams": ((), ctypes.c_int64),
        "kvcache_op_cpu_token_prefetch_bytes": ((ctypes.c_int64,), ctypes.c_int64),
        "kvcache_op_cpu_head_prefetch": ((), ctypes.c_char_p),
        "kvcache_op_key_value_cache_defaults": ((kv_attrs,), None),
        "kvcache_op_key_cache_rotary_shift_defaults": ((rot_attrs,), None),
        "kvcache_op_key_value_cache_output_shape": ((kv_attrs, tensors, ctypes.POINTER(ctypes.c_int64)) + message,
                                                    ctypes.c_int32),
        "kvcache_op_key_value_cache_cpu": ((kv_attrs, tensors, tensors, ctypes.c_int32) + message, ctypes.c_int32),
        "kvcache_op_key_value_cache_cuda": ((kv_attrs, tensors, tensors, ctypes.c_void_p) + message, ctypes.c_int32),
        "kvcache_op_key_cache_rotary_shift_cpu": ((rot_attrs, tensors, tensors, ctypes.c_int32) + message,
                                                  ctypes.c_int32),
        "kvcache_op_key_cache_rotary_shift_cuda": ((rot_attrs, tensors, tensors, ctypes.c_void_p) + message,
                                                   ctypes.c_int32),
        "kvcache_op_multi_head_attention_defaults": ((mha_attrs,), None),
        "kvcache_op_multi_head_attention_cpu": ((mha_attrs, tensors, tensors, ctypes.c_int32) + message,
                                                ctypes.c_int32),
        "kvcache_op_multi_head_cache_attention_defaults": ((mhca_attrs,), None),
        "kvcache_op_multi_head_cache_attention_cpu": ((mhca_attrs, tensors, tensors, ctypes.c_int32) + message,
                                                      ctypes.c_int32),
        "kvcache_op_multi_head_attention_cuda": ((mha_attrs, tensors, tensors, ctypes.c_void_p) + message,
                                                 ctypes.c_int32),
        "kvcache_op_multi_head_cache_attention_cuda": ((mhca_attrs, tensors, tensors, ctypes.c_void_p) + message,
                                                       ctypes.c_int32),
    }
    # The version first: a library of another version may lack functions this binding names.
    lib.kvcache_op_c_api_version.argtypes, lib.kvcache_op_c_api_version.restype = [], ctypes.c_int32
    version = lib.kvcache_op_c_api_version()
    if version != C_API_VERSION:
        raise RuntimeError(f"{path} has C API version {version}; this binding speaks version {C_API_VERSION}")
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(args), result
    return lib


def has_cuda(path: str | None = None) -> bool:
    """True when the library was built with its CUDA kernels."""
    return bool(library(path).kvcache_op_has_cuda())


def cpu_kernel(path: str | None = None) -> str:
    """The CPU kernel build KeyValueCache's CPU calls run now ("avx512", "avx2" or "generic"): the best one the
    library has and the processor runs, capped by ``$KVCACHE_OP_CPU_KERNEL``."""
    return library(path).kvcache_op_cpu_kernel().decode()


def cpu_stores(path: str | None = None) -> str:
    """How KeyValueCache's CPU gathers write outputs too large to stay cached ("side-by-side", "stream" or
    "cached"): "stream" by default, measured ahead on AMD EPYCs and on Intel Xeons of models 207 and 167, overridden
    by ``$KVCACHE_OP_STORES``; the same bits either way."""
    return library(path).kvcache_op_cpu_stores().decode()


def cpu_cached_gather(path: str | None = None) -> str:
    """How KeyValueCache's CPU gathers read a layout-3 quantized cache into outputs that stay cached
    ("head-runs" or "tokens"): chosen per CPU vendor by measurement, overridden by
    ``$KVCACHE_OP_CACHED_GATHER``; the same bits either way."""
    return library(path).kvcache_op_cpu_cached_gather().decode()


def cpu_streamed_heads(quant_bit: int, path: str | None = None) -> int:
    """How many of a token's heads (1-16) KeyValueCache's CPU gathers of a cache of ``quant_bit`` (0, 4 or 8) read
    side by side into streamed layout-3 outputs, a page run at a time, each slot's heads one output row:
    quantized heads eight on Intel processors running the AVX-512 build (measured on an Intel Xeon of model 167) and
    four elsewhere (codes and scales; measured best on an AMD EPYC), eight unquantized (measured best
    on an AMD EPYC and an Intel Xeon); overridden by ``$KVCACHE_OP_STREAMED_HEADS`` for both (a positive count;
    larger ones give 16); the same bits whatever the count. Raises ValueError for another quant_bit."""
    if type(quant_bit) is not int or quant_bit not in (0, 4, 8):  # not 8.0, not True
        raise ValueError(f"quant_bit must be 0, 4 or 8, not {quant_bit!r}")
    return int(library(path).kvcache_op_cpu_streamed_heads(quant_bit))


def cpu_gather_tile_bytes(cache_layout: int, quant_bit: int, path: str | None = None) -> int:
    """How many bytes of whole tokens KeyValueCache's CPU gathers of a cache of ``cache_layout`` and ``quant_bit``
    write to each output in turn in token order (one token where that is less than a token's row): chosen by
    measurement (a token where a token's key and value rows lie together, layouts 0 and 1, and for quantized rows
    on Intel processors; tiles where they lie apart), overridden by ``$KVCACHE_OP_GATHER_TILE`` (bytes, for all);
    quantized layout-3 gathers in token order go a token at a time whatever it says, and streamed gathers that read
    runs side by side (:func:`cpu_token_streams`) take no tiles; the same bits whatever the size. Raises ValueError
    for a layout outside 0-3 or a quant_bit other than 0, 4 and 8."""
    if type(cache_layout) is not int or cache_layout not in (0, 1, 2, 3):  # not 1.0, not True
        raise ValueError(f"cache_layout must be 0, 1, 2 or 3, not {cache_layout!r}")
    if type(quant_bit) is not int or quant_bit not in (0, 4, 8):  # not 8.0, not True
        raise ValueError(f"quant_bit must be 0, 4 or 8, not {quant_bit!r}")
    return int(library(path).kvcache_op_cpu_gather_tile_bytes(cache_layout, quant_bit))


def cpu_code_stores(path: str | None = None) -> str:
    """How KeyValueCache's CPU stores write quantized codes whose output rows are not read back ("stream" or
    "cached"): streamed by default where the AVX-512 build runs (measured ahead on AMD and Intel), overridden by
    ``$KVCACHE_OP_CODE_STORES`` (which only the AVX-512 build acts on); stores-only calls (MultiHeadCacheAttention's)
    keep them cached; the same bits either way."""
    return library(path).kvcache_op_cpu_code_stores().decode()


def cpu_token_streams(path: str | None = None) -> int:
    """How many runs of a task's rows KeyValueCache's CPU gathers read side by side into streamed outputs where a
    token's heads are one row in the cache and in the output (layouts 0-2, unquantized, no repeats, the "stream"
    store plan; rows of whole 64-byte vectors at even addresses, in the AVX-512 build, which alone reads runs): in
    the AVX-512 build 8 on Intel processors (measured on an Intel Xeon of model 167) and 4 on AMD processors
    (measured on an AMD EPYC of Zen 4), 1 (one row after another) in the other builds, overridden by
    ``$KVCACHE_OP_TOKEN_STREAMS`` (a positive count; larger ones give 16); the same bits whatever the count."""
    return int(library(path).kvcache_op_cpu_token_streams())


def cpu_token_prefetch_bytes(row_bytes: int, path: str | None = None) -> int:
    """How many bytes of a quantized token's codes (from its first head on, with their scales) KeyValueCache's CPU
    gathers in token order ask for ahead of their use where a token's heads lie together in the cache (layouts 0-2),
    for tokens whose codes (every head's) take ``row_bytes``; 0 for the whole row: 1024 on Intel processors
    (measured on an Intel Xeon of model 167: a whole 4 KiB row asked for at once stalls the reads behind it); on
    AMD processors the whole row up to 1024 bytes and 512 of longer ones (measured on an AMD EPYC of Zen 4);
    rounded down to whole heads (at least one), overridden by ``$KVCACHE_OP_TOKEN_PREFETCH`` (bytes, a non-negative
    integer, whatever the row); the same bits whatever the count. Raises ValueError for a row below one byte."""
    if type(row_bytes) is not int or not 1 <= row_bytes < 1 << 63:  # not 1.0, not True; an int64 (ctypes wraps)
        raise ValueError(f"row_bytes must be a positive int, not {row_bytes!r}")
    return int(library(path).kvcache_op_cpu_token_prefetch_bytes(row_bytes))


def cpu_head_prefetch(path: str | None = None) -> str:
    """Where KeyValueCache's CPU gathers of an unquantized layout-3 cache ask for head rows ahead of their use:
    "l2" (the second-level cache) on AMD processors, in every build (measured on an AMD EPYC of Zen 4: a slot's
    head rows, a multiple of 4 KiB apart, share a set of the first level, whose ways the rows asked for ahead
    fill), "l1" (the first) elsewhere ("l2" no faster on an Intel Xeon of model 207); overridden by
    ``$KVCACHE_OP_HEAD_PREFETCH`` ("l2" or "l1"); quantized rows go to the first level whatever it says; the same
    bits either way."""
    return library(path).kvcache_op_cpu_head_prefetch().decode()


def _integer_attribute(name: str, value) -> int:
    """``value`` as an int where it is one (whatever ``operator.index`` takes: a Python or numpy int, a 0-d integer
    array); anything else, a float included, is refused, never truncated into a call the reference refuses."""
    try:
        return operator.index(value)
    except TypeError:
        raise KeyValueCacheError(f"{name} must be an integer, got {value!r}") from None


def _attrs(struct, names, defaults_fn, given: dict, floats=()):
    unknown = set(given) - set(names)
    if unknown:
        raise TypeError(f"unknown attribute(s) {sorted(unknown)}; expected some of {list(names)}")
    attrs = struct()
    defaults_fn(ctypes.byref(attrs))
    for name, value in given.items():
        if name in floats:  # a float attribute: ctypes rounds it to the struct's float32
            setattr(attrs, name, float(value))
            continue
        value = _integer_attribute(name, value)
        if not -(2**63) <= value < 2**63:
            raise KeyValueCacheError(f"{name} = {value} does not fit in int64")
        setattr(attrs, name, value)
    return attrs


def _check(code: int, message: ctypes.Array, error=KeyValueCacheError) -> None:
    if code == OK:
        return
    text = message.value.decode("utf-8", "replace")
    if code == INVALID_ARGUMENT:
        raise error(text)
    raise RuntimeError(text)


def c_array(tensors, count: int, what: str, error=KeyValueCacheError, optional: bool = True) -> ctypes.Array:
    """A C array of exactly ``count`` :class:`Tensor` s (``what`` names them in the error; ``optional``: some may be
    left out as ``ABSENT``). The C entry points read every one of an op's tensors, so a shorter list would have them
    read past its end: ``error`` instead."""
    tensors = list(tensors)
    if len(tensors) != count:
        hint = " (ABSENT for an optional one left out)" if optional else ""
        raise error(f"{what} must be {count} Tensor objects{hint}, got {len(tensors)}")
    others = sorted({type(t).__name__ for t in tensors if not isinstance(t, Tensor)})
    if others:
        raise error(f"{what} must be Tensor objects, got {', '.join(others)} among them")
    return (CTensor * count)(*(t.to_c() for t in tensors))


def c_tensor(tensor, what: str, error=KeyValueCacheError) -> CTensor:
    """``tensor`` (one :class:`Tensor`) as the C struct; ``error`` naming ``what`` for anything else."""
    if not isinstance(tensor, Tensor):
        raise error(f"{what} must be a Tensor, got {type(tensor).__name__}")
    return tensor.to_c()


def key_value_cache_attributes(library_file: str | None = None, **attributes) -> CKeyValueCacheAttrs:
    """The C attribute struct: the spec's defaults (from the library), overridden by ``attributes``."""
    lib = library(library_file)
    return _attrs(CKeyValueCacheAttrs, KV_ATTRIBUTES, lib.kvcache_op_key_value_cache_defaults, attributes)


def run_key_value_cache(inputs, outputs, *, device: str = "cpu", stream: int = 0, num_threads: int = 1,
                        library_file: str | None = None, **attributes) -> None:
    """Runs KeyValueCache on raw buffers. ``inputs``: 10 :class:`Tensor` in the op's order (``ABSENT`` for
    no scale); ``outputs``: 2 :class:`Tensor` of the shape :func:`output_shape` gives. On ``"cuda"``,
    inputs 0, 1, 8, 9 and the outputs are device addresses and the index inputs host addresses; the
    kernels are enqueued on ``stream`` (a ``cudaStream_t`` as an int) and not waited for."""
    lib = library(library_file)
    attrs = key_value_cache_attributes(library_file, **attributes)
    message = ctypes.create_string_buffer(4096)
    c_in = c_array(inputs, 10, "KeyValueCache's inputs")
    c_out = c_array(outputs, 2, "KeyValueCache's outputs", optional=False)
    if device == "cpu":
        code = lib.kvcache_op_key_value_cache_cpu(ctypes.byref(attrs), c_in, c_out, int(num_threads), message,
                                                  len(message))
    elif device == "cuda":
        code = lib.kvcache_op_key_value_cache_cuda(ctypes.byref(attrs), c_in, c_out, stream or None, message,
                                                   len(message))
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    _check(code, message)


def output_shape(inputs, *, library_file: str | None = None, **attributes) -> tuple:
    """(kv_tokens, H * num_repeat, Dh) of a call after validating it (only index data is read)."""
    lib = library(library_file)
    attrs = key_value_cache_attributes(library_file, **attributes)
    message = ctypes.create_string_buffer(4096)
    shape = (ctypes.c_int64 * 3)()
    _check(lib.kvcache_op_key_value_cache_output_shape(ctypes.byref(attrs),
                                                        c_array(inputs, 10, "KeyValueCache's inputs"), shape, message,
                                                        len(message)), message)
    return tuple(shape)


class HostBuffers:
    """numpy arrays as C :class:`Tensor` s for one call: keeps every buffer alive until the call is over;
    an int4 array (one code per byte in numpy) is passed packed, and :meth:`finish` writes back the codes the
    call changed in written int4 arrays (only those: a call on another layer of the same array, running beside
    this one, keeps its own). A read input that is not C-contiguous is passed as a copy. Since the C entry
    points cannot see where a copy came from, :meth:`check_apart` checks those arrays against the written ones
    here, with the C entry points' message. Errors are ``error`` (the op's class)."""

    def __init__(self, error=KeyValueCacheError):
        self.keep, self.write_back, self.error = [], [], error
        self.given = {}  # name -> (the caller's array, passed as a copy)

    def tensor(self, name: str, array, written: bool = False) -> Tensor:
        if array is None:
            return ABSENT
        if written:
            if not isinstance(array, np.ndarray):
                raise self.error(f"{name} must be a numpy array: it is written in place")
            if not (array.flags.c_contiguous and array.flags.writeable):
                raise self.error(f"{name} must be a writable C-contiguous array: it is written in place")
        array = np.asarray(array)
        if array.ndim > MAX_RANK:
            raise self.error(f"{name} has rank {array.ndim}, more than the C entry points' {MAX_RANK}")
        if not array.dtype.isnative:
            raise self.error(f"{name} has dtype {array.dtype.str}, not in this machine's byte order: "
                             "pass array.astype(array.dtype.newbyteorder('='))")
        if array.dtype == INT4:  # one code per byte in numpy; the kernels take ONNX's packed layout
            # a written one is packed from one snapshot, which finish compares with: what another thread writes
            # into the array meanwhile is in neither, so it is never written back over
            source = array.copy() if written else array
            packed = pack_int4(source)
            self.keep.append(packed)
            self.given[name] = (array, True)
            if written:
                self.write_back.append((array, packed, source))
            return Tensor(ONNX_TYPES[INT4], array.shape, packed.ctypes.data)
        self.given[name] = (array, not array.flags.c_contiguous)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        self.keep.append(array)
        try:
            element = onnx_type(array.dtype)
        except KeyValueCacheError as error:
            raise self.error(f"{name}: {error}") from None
        return Tensor(element, array.shape, array.ctypes.data)

    def check_apart(self, rules) -> None:
        """Refuses, for each ``(written, others)`` of ``rules`` (the C entry points' own pairs), ``written``
        sharing memory with one of ``others`` where either was passed as a copy (the C entry points check the rest
        themselves, with this message)."""
        for written, others in rules:
            if written not in self.given:
                continue
            array, copied = self.given[written]
            for name in others:
                if name in self.given and (copied or self.given[name][1]) \
                        and np.may_share_memory(array, self.given[name][0]):
                    raise self.error(f"{written} overlaps {name}: the op writes {written} while it reads or writes "
                                     f"{name}, so they must not share memory")

    def finish(self) -> None:
        for array, packed, before in self.write_back:
            after = unpack_int4(packed, array.size).reshape(array.shape).astype(INT4)
            changed = after != before
            array[changed] = after[changed]


def key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                    cache, scale=None, *, num_threads: int = 1, library_file: str | None = None, **attributes):
    """The reference's :func:`~kvcache_op.reference.key_value_cache` on the library's CPU kernel through the
    C entry point: returns ``(key, value)``; writes ``cache`` / ``scale`` in place."""
    args = HostBuffers()
    scale = effective_scale(scale, attributes.get("quant_bit", 0))  # an empty one is absent: never written
    given = dict(current_key=current_key, current_value=current_value, seqstarts=seqstarts, kvstarts=kvstarts,
                 cachestarts=cachestarts, start_pos=start_pos, max_seqlen=max_seqlen, max_kvlen=max_kvlen,
                 cache=cache, scale=scale)
    inputs = [args.tensor(name, given[name], written=name in ("cache", "scale")) for name in KV_INPUTS]
    shape = output_shape(inputs, library_file=library_file, **attributes)
    args.check_apart(KV_APART)
    dtype = np.asarray(current_key).dtype
    key, value = np.empty(shape, dtype), np.empty(shape, dtype)
    outputs = [Tensor(ONNX_TYPES[dtype], shape, out.ctypes.data) for out in (key, value)]
    run_key_value_cache(inputs, outputs, device="cpu", num_threads=num_threads, library_file=library_file,
                        **attributes)
    args.finish()
    return key, value


def rotary_shift_attributes(library_file: str | None = None, **attributes) -> CRotaryShiftAttrs:
    """The C attribute struct of KeyCacheRotaryShift: the spec's defaults, overridden by ``attributes``."""
    lib = library(library_file)
    return _attrs(CRotaryShiftAttrs, ROTARY_ATTRIBUTES, lib.kvcache_op_key_cache_rotary_shift_defaults, attributes)


def run_key_cache_rotary_shift(inputs, output, *, device: str = "cpu", stream: int = 0, num_threads: int = 1,
                               library_file: str | None = None, **attributes) -> None:
    """Runs KeyCacheRotaryShift over raw buffers: ``inputs`` are 5 :class:`Tensor` (cache, scale or
    ``ABSENT``, slots, cos, sin), ``output`` the ``(N,)`` int64 host :class:`Tensor` for ``slots_out``.
    On ``"cuda"`` the cache and scale are device addresses (slots, cos, sin, output host ones) and the
    rotation is enqueued on ``stream`` and not waited for. Validates everything before writing."""
    lib = library(library_file)
    attrs = rotary_shift_attributes(library_file, **attributes)
    message = ctypes.create_string_buffer(4096)
    c_in = c_array(inputs, 5, "KeyCacheRotaryShift's inputs")
    c_out = ctypes.byref(c_tensor(output, "KeyCacheRotaryShift's output"))
    if device == "cpu":
        code = lib.kvcache_op_key_cache_rotary_shift_cpu(ctypes.byref(attrs), c_in, c_out, int(num_threads), message,
                                                         len(message))
    elif device == "cuda":
        code = lib.kvcache_op_key_cache_rotary_shift_cuda(ctypes.byref(attrs), c_in, c_out, stream or None, message,
                                                          len(message))
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    _check(code, message)


def key_cache_rotary_shift(cache, scale, slots, cos, sin, *, num_threads: int = 1, library_file: str | None = None,
                           **attributes):
    """The reference's :func:`~kvcache_op.reference.key_cache_rotary_shift` on the library's CPU kernel:
    rotates the keys of ``slots`` in place (cache, and scale when quantized); returns the slots."""
    args = HostBuffers()
    scale = effective_scale(scale, attributes.get("quant_bit", 0))
    inputs = [args.tensor("cache", cache, written=True), args.tensor("scale", scale, written=True),
              args.tensor("slots", slots), args.tensor("cos", cos), args.tensor("sin", sin)]
    args.check_apart(ROTARY_APART)
    count = int(np.asarray(slots).size) if np.asarray(slots).ndim == 1 else 0
    out = np.empty(count, np.int64)
    run_key_cache_rotary_shift(inputs, Tensor(ONNX_TYPES[np.dtype(np.int64)], (count,), out.ctypes.data),
                               num_threads=num_threads, library_file=library_file, **attributes)
    args.finish()
    return out


def multi_head_attention_attributes(library_file: str | None = None, **attributes) -> CMultiHeadAttentionAttrs:
    """The C attribute struct: the spec's defaults (from the library; num_heads and head_dim 0, which the
    library refuses), overridden by ``attributes``."""
    lib = library(library_file)
    return _attrs(CMultiHeadAttentionAttrs, MHA_ATTRIBUTES, lib.kvcache_op_multi_head_attention_defaults, attributes,
                  floats=("softmax_scale", "softcap"))


def run_multi_head_attention(inputs, output, *, device: str = "cpu", stream: int = 0, num_threads: int = 1,
                             library_file: str | None = None, **attributes) -> None:
    """Runs MultiHeadAttention on raw buffers. ``inputs``: 9 :class:`Tensor` in the op's order (``ABSENT`` for no
    attn_mask); ``output``: one :class:`Tensor` of query's type and shape, written only when the call is valid.
    ``device="cuda"``: query, key, value, attn_mask and the output are device memory (index inputs host memory)
    and the work is enqueued on ``stream`` (a cudaStream_t as an int); ``num_threads`` is then unused."""
    _check_device(device)
    lib = library(library_file)
    attrs = multi_head_attention_attributes(library_file, **attributes)
    message = ctypes.create_string_buffer(4096)
    c_in = c_array(inputs, 9, "MultiHeadAttention's inputs", MultiHeadAttentionError)
    c_out = ctypes.byref(c_tensor(output, "MultiHeadAttention's output", MultiHeadAttentionError))
    if device == "cuda":
        code = lib.kvcache_op_multi_head_attention_cuda(ctypes.byref(attrs), c_in, c_out, ctypes.c_void_p(stream),
                                                        message, len(message))
    else:
        code = lib.kvcache_op_multi_head_attention_cpu(ctypes.byref(attrs), c_in, c_out, int(num_threads), message,
                                                       len(message))
    _check(code, message, MultiHeadAttentionError)


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def multi_head_attention(query, key, value, seqstarts, kvstarts, decoding_batches, max_seqlen, max_kvlen,
                         attn_mask=None, *, num_threads: int = 1, library_file: str | None = None, **attributes):
    """The reference's :func:`~kvcache_op.reference.multi_head_attention` on the library's CPU kernel through the
    C entry point: returns the output, of query's dtype and shape (within the spec's tolerance of the
    reference, not bit-exact)."""
    args = HostBuffers(MultiHeadAttentionError)
    given = dict(query=query, key=key, value=value, seqstarts=seqstarts, kvstarts=kvstarts,
                 decoding_batches=decoding_batches, max_seqlen=max_seqlen, max_kvlen=max_kvlen, attn_mask=attn_mask)
    inputs = [args.tensor(name, given[name]) for name in MHA_INPUTS]
    query = np.asarray(query)
    out = np.empty(query.shape, query.dtype)
    output = Tensor(inputs[0].type, query.shape, out.ctypes.data)
    run_multi_head_attention(inputs, output, num_threads=num_threads, library_file=library_file, **attributes)
    return out


def multi_head_cache_attention_attributes(library_file: str | None = None, **attributes) -> CMultiHeadCacheAttentionAttrs:
    """The C attribute struct of MultiHeadCacheAttention: the spec's defaults (num_heads and head_dim 0, which the
    library refuses), overridden by ``attributes``."""
    lib = library(library_file)
    return _attrs(CMultiHeadCacheAttentionAttrs, MHCA_ATTRIBUTES, lib.kvcache_op_multi_head_cache_attention_defaults,
                  attributes, floats=("softmax_scale", "softcap"))


def run_multi_head_cache_attention(inputs, output, *, device: str = "cpu", stream: int = 0, num_threads: int = 1,
                                   library_file: str | None = None, **attributes) -> None:
    """Runs MultiHeadCacheAttention on raw buffers. ``inputs``: 13 :class:`Tensor` in the op's order (``ABSENT`` for
    no scale or attn_mask); ``output``: one :class:`Tensor` of query's type and shape. On an error
    (:class:`~kvcache_op.reference.KeyValueCacheError`) nothing is written, the cache included. ``device="cuda"``:
    every tensor but the index inputs is device memory, and the work is enqueued on ``stream``."""
    _check_device(device)
    lib = library(library_file)
    attrs = multi_head_cache_attention_attributes(library_file, **attributes)
    message = ctypes.create_string_buffer(4096)
    c_in = c_array(inputs, 13, "MultiHeadCacheAttention's inputs", KeyValueCacheError)
    c_out = ctypes.byref(c_tensor(output, "MultiHeadCacheAttention's output", KeyValueCacheError))
    if device == "cuda":
        code = lib.kvcache_op_multi_head_cache_attention_cuda(ctypes.byref(attrs), c_in, c_out,
                                                              ctypes.c_void_p(stream), message, len(message))
    else:
        code = lib.kvcache_op_multi_head_cache_attention_cpu(ctypes.byref(attrs), c_in, c_out, int(num_threads),
                                                             message, len(message))
    _check(code, message)


def multi_head_cache_attention(query, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                               decoding_batches, max_seqlen, max_kvlen, cache, scale=None, attn_mask=None, *,
                               num_threads: int = 1, library_file: str | None = None, **attributes):
    """The reference's :func:`~kvcache_op.reference.multi_head_cache_attention` on the library's CPU kernel through
    the C entry point: writes ``cache`` / ``scale`` in place and returns the output (the cache bit-exact, the
    output within the spec's tolerance of the reference)."""
    args = HostBuffers()
    scale = effective_scale(scale, attributes.get("quant_bit", 0))  # an empty one is absent: never written
    given = dict(query=query, current_key=current_key, current_value=current_value, seqstarts=seqstarts,
                 kvstarts=kvstarts, cachestarts=cachestarts, start_pos=start_pos, decoding_batches=decoding_batches,
                 max_seqlen=max_seqlen, max_kvlen=max_kvlen, cache=cache, scale=scale, attn_mask=attn_mask)
    inputs = [args.tensor(name, given[name], written=name in ("cache", "scale")) for name in MHCA_INPUTS]
    args.check_apart(MHCA_APART)
    query = np.asarray(query)
    out = np.empty(query.shape, query.dtype)
    run_multi_head_cache_attention(inputs, Tensor(inputs[0].type, query.shape, out.ctypes.data),
                                   num_threads=num_threads, library_file=library_file, **attributes)
    args.finish()
    return out
