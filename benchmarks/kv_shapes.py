"""The KeyValueCache benchmarks' cases (the CPU and the CUDA benchmark measure the same shapes): shapes, the
inputs of one call, the bytes it moves, and one ONNX Runtime call with inputs and outputs bound once."""

import dataclasses

import numpy as np

from .bound_session import aligned_copy, aligned_empty, bound_run


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``batch`` sequences of ``seqlen`` new tokens after ``start_pos`` cached ones."""

    name: str
    batch: int
    seqlen: int
    start_pos: int
    heads: int = 8
    head_dim: int = 128
    page_size: int = 64


#: A decode step, a prefill (every token it loads it also stores: the stores write the outputs), a chunk of a
#: chunked prefill (three quarters of what it loads were stored before: the gathers into outputs that stay cached),
#: a decode step of the same bytes with 32 heads that each keep their own keys (multi-head attention, as Llama 2
#: 7B's): four times the head rows a token, which layout 3 keeps apart; and the decode step in pages of 16 slots
#: (vLLM's default block size): four times the page turns, a page's run of a head in layout 3 a quarter as long.
SHAPES = [Shape("decode", 64, 1, 1023), Shape("prefill", 4, 512, 0), Shape("chunk", 4, 256, 768),
          Shape("decode-32h", 16, 1, 1023, heads=32), Shape("decode-p16", 64, 1, 1023, page_size=16)]
#: --quick: the same mix, tiny (a smoke run of the tool, not a measurement).
QUICK_SHAPES = [Shape("decode", 4, 1, 63, heads=2, head_dim=32, page_size=16),
                Shape("prefill", 2, 32, 0, heads=2, head_dim=32, page_size=16),
                Shape("chunk", 2, 16, 48, heads=2, head_dim=32, page_size=16)]


def make_indices(shape: Shape, rng, cache_mode: int = 1) -> dict:
    """The six index inputs of one call. Paged (cache_mode 1): every sequence owns its pages, in a page table
    shuffled by ``rng``; ``cachestarts`` holds each page's first slot, so the cache needs
    ``cachestarts.size * page_size`` slots. Offset (cache_mode 0): sequence b owns the ``MaxS`` slots from
    ``b * MaxS`` (MaxS: kvlen rounded up to a page), so the cache needs ``batch * MaxS`` slots."""
    kvlen = shape.start_pos + shape.seqlen
    pages_per_seq = -(-kvlen // shape.page_size)
    if cache_mode == 1:
        pages = shape.batch * pages_per_seq
        table = rng.permutation(pages).reshape(shape.batch, pages_per_seq).astype(np.int64) * shape.page_size
    else:
        table = np.arange(shape.batch, dtype=np.int64) * pages_per_seq * shape.page_size
    return {
        "seqstarts": np.arange(shape.batch + 1, dtype=np.int64) * shape.seqlen,
        "kvstarts": np.arange(shape.batch + 1, dtype=np.int64) * kvlen,
        "cachestarts": table,
        "start_pos": np.full(shape.batch, shape.start_pos, np.int64),
        "max_seqlen": np.array(shape.seqlen, np.int64),
        "max_kvlen": np.array(kvlen, np.int64),
    }


def make_inputs(shape: Shape, quant_bit: int, layout: int, seed: int = 0, cache_mode: int = 1):
    """Inputs of one call (:func:`make_indices`), float16 values, int8 codes with float16 scales; the tensors
    start on cache lines, as ONNX Runtime places its own buffers."""
    from ..reference import cache_shape

    rng = np.random.default_rng(seed)
    indices = make_indices(shape, rng, cache_mode)
    tokens = shape.batch * shape.seqlen
    cache_dtype = np.int8 if quant_bit else np.float16
    max_t = indices["cachestarts"].size * shape.page_size if cache_mode == 1 else (
        shape.batch * -(-(shape.start_pos + shape.seqlen) // shape.page_size) * shape.page_size)
    current_key = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    current_value = rng.standard_normal((tokens, shape.heads, shape.head_dim)).astype(np.float16)
    inputs = {
        "current_key": aligned_copy(current_key),
        "current_value": aligned_copy(current_value),
        **indices,
        "cache": aligned_copy(rng.integers(-127, 128, cache_shape(layout, 1, max_t, shape.heads, shape.head_dim)
                                           ).astype(cache_dtype)),
        "scale": None,
    }
    if quant_bit:
        inputs["scale"] = aligned_copy(rng.uniform(0.001, 0.02, cache_shape(layout, 1, max_t, shape.heads,
                                                                              shape.head_dim // 8)).astype(np.float16))
    return inputs


def bytes_moved_parts(shape: Shape, quant_bit: int, value_bytes: int = 2, scale_bytes: int = 2,
                      quant_group: int = 8) -> tuple:
    """(store, gather): bytes read plus bytes written by the two halves of one call (num_repeat 1), keys and
    values. Store reads the new rows and writes their cache rows (and scales); gather reads the cache rows
    (and scales) of every gathered token and writes the output rows. Index inputs are not counted.
    ``value_bytes``: element size of current_key and the outputs; the cache holds that type unquantized,
    one byte per element with quant_bit 8."""
    tokens = shape.batch * shape.seqlen
    kv_tokens = shape.batch * (shape.start_pos + shape.seqlen)
    row = shape.heads * shape.head_dim
    cache_row = row * (1 if quant_bit else value_bytes) + (row // quant_group * scale_bytes if quant_bit else 0)
    return 2 * tokens * (row * value_bytes + cache_row), 2 * kv_tokens * (cache_row + row * value_bytes)


def bytes_moved(shape: Shape, quant_bit: int) -> int:
    """Bytes read plus bytes written by one call (stores and gathers, keys and values; float16 values,
    float16 scales in groups of 8): the sum of :func:`bytes_moved_parts`."""
    return sum(bytes_moved_parts(shape, quant_bit))


def case_attrs(shape: Shape, quant_bit: int, layout: int, cache_mode: int) -> dict:
    """The op's attributes in one benchmark case (groups of 8 where quantized)."""
    return dict(quant_bit=quant_bit, quant_group=8, cache_mode=cache_mode, cache_layout=layout,
                page_size=shape.page_size)


def plain_runner(inputs, attrs, threads, config: dict | None = None):
    """The call as a plain ``session.run`` makes it: ONNX Runtime allocates the key and value outputs afresh
    each call (what a user without IOBinding pays on top of the kernel)."""
    from .. import spec
    from ..ort_ops import make_session

    session = make_session(spec.make_model(inputs, **attrs), intra_op_num_threads=threads, config=config)
    return lambda: session.run(None, inputs)


def ort_runner(inputs, attrs, threads, output_offset: int = 0, library: str | None = None, config: dict | None = None):
    """A zero-overhead call of the op: inputs and outputs bound once, then run_with_iobinding; the outputs start
    ``output_offset`` bytes past a cache line (0: where ONNX Runtime's allocator places them); ``library``: another
    build of the op's library to run (default: the one :func:`kvcache_op.ort_ops.library_path` names); ``config``:
    session config entries (:data:`~.bound_session.NO_SPINNING` where sessions run side by side)."""
    from .. import spec

    kv_tokens = int(inputs["kvstarts"][-1])
    out_shape = (kv_tokens, inputs["current_key"].shape[1], inputs["current_key"].shape[2])
    outputs = {name: aligned_empty(out_shape, np.float16, output_offset) for name in ("key", "value")}
    return bound_run(spec.make_model(inputs, **attrs), inputs, outputs, threads, config=config, library=library)
