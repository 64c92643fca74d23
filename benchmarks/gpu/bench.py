"""CUDA benchmark of the KeyValueCache kernels: bytes moved, GB/s, and ratios measured side by side in one
run on one CUDA stream.

    python -m kvcache_op.benchmarks.gpu.bench --out benchmarks/gpu
    python -m kvcache_op.benchmarks.gpu.bench --quick     # tiny shapes: a smoke run

Needs a CUDA GPU, torch with CUDA (device memory, streams, events) and a build of the library with its
CUDA kernels; without one of them it exits with status 2 and one line saying what is missing.

Per case, everything on device memory that torch allocates:

* op: the kernels through the C entry point (``c_api.run_key_value_cache(..., device="cuda")``), index
  inputs from host numpy arrays as the entry point takes them;
* copy: ``copy_`` of ``bytes_moved / 2`` bytes device to device (a copy of N bytes reads N and writes N,
  so it moves as many bytes as the op);
* torch: the same op as vectorized torch (:mod:`kvcache_op.benchmarks.gpu.torch_baseline`): ``index_copy_``
  of the new rows into their cache slots, ``index_select`` of the gathered rows (quant_bit 8: quantize
  before the store, dequantize after the gather). Its slot vectors are computed and copied to the device
  once, before timing.

Times: CUDA events around each call (the op's index upload included), after a warm-up, median of the
repeats, in three rounds that time the op, the copy and torch once each, in turn (a row's times are the medians
over the rounds, its ratios the medians of the rounds' ratios); the GPU is held busy while the calls are enqueued
so that, unless a call waits for the stream, the events time GPU work and not host gaps.
``host`` is the wall-clock time of the ``run_key_value_cache`` Python call itself (binding, validation,
index snapshot, the index upload's enqueue, launches; not waiting for the kernels), each call on an idle
stream, median; ``queued`` the same for calls issued back to back without waiting (a call that has to wait
for earlier work on the stream, e.g. for a pageable upload, shows it there).

Bytes moved, as for the CPU tool (``kv_shapes.bytes_moved_parts``), keys and values, num_repeat 1:
store = 2 x seqstarts[B] x (H*Dh x sizeof(T1) read + H*Dh x sizeof(cache) written [+ H*Dh/8 x sizeof(scale)
written]); gather = 2 x kvstarts[B] x (H*Dh x sizeof(cache) [+ H*Dh/8 x sizeof(scale)] read + H*Dh x
sizeof(T1) written). Index inputs are not counted. GB/s = bytes moved / time / 1e9. ``op / copy`` = copy
time / op time (1.0: the op moves its bytes as fast as a plain copy); ``vs torch`` = torch time / op time
(above 1: the op is faster).
"""

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np

from ...arguments import OneLineParser, at_least, out_folder

from ...reference.dtypes import BFLOAT16
from ...validation.call_slots import call_slots
from ..environment import recorded_command
from ..kv_shapes import QUICK_SHAPES, Shape, bytes_moved_parts, make_indices

#: numpy dtype of each T1 the benchmark runs, by name (also torch's name of it).
VALUE_TYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16}
SCALE_TYPE = "float16"
QUANT_GROUP = 8
#: torch device of the measured tensors (the timing is CUDA's: events, streams).
DEVICE = "cuda"
#: GPU cycles the stream is held before timed calls are enqueued (tens of ms on current GPUs).
HOLD_CYCLES = 50_000_000


@dataclasses.dataclass(frozen=True)
class Case:
    shape: Shape
    dtype: str
    quant_bit: int
    layout: int

    def attributes(self) -> dict:
        return dict(quant_bit=self.quant_bit, quant_group=QUANT_GROUP, cache_mode=1, cache_layout=self.layout,
                    page_size=self.shape.page_size)

    def label(self) -> str:
        return (f"{self.shape.name} B={self.shape.batch} {self.dtype} q{self.quant_bit} L{self.layout} "
                f"page={self.shape.page_size}")


def cases(quick: bool) -> list:
    """The measured cases: decode B=256 kvlen 2048 (both T1, quant 0/8, layouts 0/3, pages of 16 and 128)
    and prefill B=8 seqlen 2048 (float16, quant 0/8, layout 0, pages of 128); H=8, Dh=128. ``quick``: the
    CPU tool's tiny shapes, for a smoke run."""
    if quick:
        tiny = {shape.name: shape for shape in QUICK_SHAPES}
        decode, prefill = tiny["decode"], tiny["prefill"]
        return ([Case(decode, t, q, layout) for t in VALUE_TYPES for q in (0, 8) for layout in (0, 3)]
                + [Case(prefill, "float16", q, 0) for q in (0, 8)])
    out = []
    for page in (16, 128):
        decode = Shape("decode", 256, 1, 2047, heads=8, head_dim=128, page_size=page)
        out += [Case(decode, t, q, layout) for t in VALUE_TYPES for q in (0, 8) for layout in (0, 3)]
    prefill = Shape("prefill", 8, 2048, 0, heads=8, head_dim=128, page_size=128)
    return out + [Case(prefill, "float16", q, 0) for q in (0, 8)]


def case_bytes(case: Case) -> tuple:
    """(store, gather) bytes of a case, the CPU tool's definition with this case's element sizes."""
    return bytes_moved_parts(case.shape, case.quant_bit, VALUE_TYPES[case.dtype].itemsize,
                             np.dtype(SCALE_TYPE).itemsize, QUANT_GROUP)


def missing_requirements() -> list:
    """What this machine lacks for the CUDA benchmark, one phrase each (empty: nothing)."""
    from ...capi import c_api
    from ...ort_ops import library_available

    missing = []
    try:
        if not library_available():
            missing.append("the kvcache-op library is not built")
        elif not c_api.has_cuda():
            missing.append("the kvcache-op library was built without its CUDA kernels (rebuild where nvcc is "
                           "found, KVCACHE_OP_CUDA=1)")
    except (OSError, RuntimeError) as error:  # a library that does not load, or speaks another C API version
        missing.append(f"the kvcache-op library cannot be used ({error})")
    try:
        import torch
    except ImportError:
        missing.append("torch is not installed (a CUDA build of torch provides device memory and timing)")
    else:
        if not torch.cuda.is_available():
            missing.append(f"torch {torch.__version__} sees no CUDA GPU")
    return missing


class DeviceCall:
    """One case's call in torch memory: the tensors, their C descriptions, the host index arrays (kept alive
    here) and the torch baseline on the same cache. Same ``seed``, same bytes. ``device`` "cpu" runs the
    op's CPU kernel on host tensors through the same entry point (a check of this wiring without a GPU)."""

    def __init__(self, case: Case, seed: int = 0, device: str = "cuda"):
        import torch

        from ...capi import c_api
        from ...reference import cache_shape
        from .torch_baseline import TorchKeyValueCache

        shape, attrs = case.shape, case.attributes()
        indices = make_indices(shape, np.random.default_rng(seed))
        max_t = indices["cachestarts"].size * shape.page_size
        value_np = VALUE_TYPES[case.dtype]
        value_t = getattr(torch, case.dtype)
        g = torch.Generator(device=device).manual_seed(seed)
        tokens = int(indices["seqstarts"][-1])
        current = [torch.randn((tokens, shape.heads, shape.head_dim), generator=g, device=device, dtype=value_t)
                   for _ in range(2)]
        cache_dims = cache_shape(case.layout, 1, max_t, shape.heads, shape.head_dim)
        if case.quant_bit:
            cache = torch.randint(-127, 128, cache_dims, generator=g, device=device, dtype=torch.int8)
            scale = torch.empty(cache_shape(case.layout, 1, max_t, shape.heads, shape.head_dim // QUANT_GROUP),
                                device=device, dtype=getattr(torch, SCALE_TYPE)).uniform_(0.001, 0.02, generator=g)
        else:
            cache = torch.randn(cache_dims, generator=g, device=device, dtype=value_t)
            scale = None
        self.host = c_api.HostBuffers()  # the index arrays live as long as this call

        def described(t, dtype):
            return c_api.Tensor(c_api.onnx_type(dtype), tuple(t.shape), t.data_ptr()) if t is not None else c_api.ABSENT

        by_name = {"current_key": described(current[0], value_np), "current_value": described(current[1], value_np),
                   "cache": described(cache, np.int8 if case.quant_bit else value_np),
                   "scale": described(scale, np.dtype(SCALE_TYPE))}
        self.inputs = [by_name[n] if n in by_name else self.host.tensor(n, indices[n]) for n in c_api.KV_INPUTS]
        out_shape = c_api.output_shape(self.inputs, **attrs)
        self.key, self.value = (torch.empty(out_shape, device=device, dtype=value_t) for _ in range(2))
        self.outputs = [described(self.key, value_np), described(self.value, value_np)]
        self.current_key, self.current_value, self.cache, self.scale = current[0], current[1], cache, scale
        self.attributes, self.device = attrs, device
        self.stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
        self._run = c_api.run_key_value_cache
        store, load = call_slots(indices["seqstarts"], indices["kvstarts"], indices["cachestarts"],
                                 indices["start_pos"], cache_mode=1, page_size=shape.page_size)
        self.baseline = TorchKeyValueCache(cache, scale, torch.from_numpy(store).to(device),
                                           torch.from_numpy(load).to(device), cache_layout=case.layout,
                                           quant_bit=case.quant_bit, quant_group=QUANT_GROUP)

    def run_op(self) -> None:
        """Enqueues the op on the stream that was current at construction; does not wait for the kernels."""
        self._run(self.inputs, self.outputs, device=self.device, stream=self.stream, **self.attributes)

    def run_torch(self) -> None:
        """Enqueues the torch baseline on torch's current stream, writing the same cache and outputs."""
        self.baseline(self.current_key, self.current_value, self.key, self.value)


def kernel_ms(fn, warmup: int, repeats: int) -> float:
    """Median GPU time of ``fn()`` in ms: CUDA events recorded around each call on the current stream."""
    import torch

    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    hold = getattr(torch.cuda, "_sleep", None)
    if hold is not None:  # the GPU waits while the host enqueues: no host gap lands between two events
        hold(HOLD_CYCLES)
    for start, end in events:
        start.record(stream)
        fn()
        end.record(stream)
    stream.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_ms(fn, warmup: int, repeats: int, *, idle: bool) -> float:
    """Median wall-clock time of the ``fn()`` call returning, in ms. ``idle``: each call starts on a drained
    stream (the host cost alone); else calls follow each other unwaited, as in a serving loop, so a call that
    has to wait for earlier work on the stream shows it."""
    import torch

    stream = torch.cuda.current_stream()
    for _ in range(warmup):
        fn()
    stream.synchronize()
    times = []
    for _ in range(repeats):
        if idle:
            stream.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    stream.synchronize()
    return statistics.median(times) * 1e3


#: Rounds of each row: each times the op, the copy and torch once, in turn (none gets a second chance).
ROUNDS = 3


def measure(case: Case, warmup: int, repeats: int, rounds: int = ROUNDS) -> dict:
    """One row: op, copy and torch times of ``case`` on the current stream, in ``rounds`` rounds that time each once
    in turn; times are medians over the rounds, ``vs_copy`` and ``vs_torch`` the medians of the rounds' ratios."""
    import torch

    call = DeviceCall(case, device=DEVICE)
    store, gather = case_bytes(case)
    moved = store + gather
    src = torch.ones(moved // 2, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)

    timed = {"op": [], "copy": [], "torch": []}
    for _ in range(rounds):
        for name, fn in (("op", call.run_op), ("copy", copy), ("torch", call.run_torch)):
            timed[name].append(kernel_ms(fn, warmup, repeats))
    op_ms, copy_ms, torch_ms = (statistics.median(timed[name]) for name in ("op", "copy", "torch"))
    ratio = {name: statistics.median(a / b for a, b in zip(timed[top], timed[bottom]))
             for name, top, bottom in (("vs_copy", "copy", "op"), ("torch_vs_copy", "copy", "torch"),
                                       ("vs_torch", "torch", "op"))}
    call_ms = host_ms(call.run_op, warmup, repeats, idle=True)
    queued_ms = host_ms(call.run_op, warmup, repeats, idle=False)
    shape = case.shape
    return {
        "shape": shape.name, "B": shape.batch, "seqlen": shape.seqlen, "kvlen": shape.start_pos + shape.seqlen,
        "H": shape.heads, "Dh": shape.head_dim, "page_size": shape.page_size, "dtype": case.dtype,
        "quant_bit": case.quant_bit, "layout": case.layout, "bytes_store": store, "bytes_gather": gather,
        "bytes_moved": moved, "op_ms": op_ms, "host_ms": call_ms, "host_queued_ms": queued_ms,
        "copy_ms": copy_ms, "torch_ms": torch_ms,
        "op_GBps": moved / op_ms / 1e6, "copy_GBps": moved / copy_ms / 1e6, "torch_GBps": moved / torch_ms / 1e6,
        **ratio, "rounds": rounds,
    }


HEADER = (f"{'case':44s} {'MB':>8s} {'op ms':>8s} {'host ms':>8s} {'queued':>8s} {'op GB/s':>8s} "
          f"{'copy GB/s':>9s} {'torch GB/s':>10s} {'op/copy':>7s} {'vs torch':>8s}")


def table_line(case: Case, row: dict) -> str:
    return (f"{case.label():44s} {row['bytes_moved'] / 1e6:8.1f} {row['op_ms']:8.3f} {row['host_ms']:8.3f} "
            f"{row['host_queued_ms']:8.3f} {row['op_GBps']:8.1f} {row['copy_GBps']:9.1f} {row['torch_GBps']:10.1f} "
            f"{row['vs_copy']:6.2f}x {row['vs_torch']:7.2f}x")


def build_parser(prog: str = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog or "python -m kvcache_op.benchmarks.gpu.bench",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    parser.add_argument("--repeats", type=at_least(1), default=20)
    parser.add_argument("--out", type=out_folder, help="folder for results.md/json and chart.png")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: checks the tool runs, measures nothing")
    return parser


def main(argv=None, prog: str = None) -> int:
    """Runs the CUDA benchmark; 0 when every case ran, 2 (one line on stderr) when the machine lacks what it
    needs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    missing = missing_requirements()
    if missing:
        print("CUDA benchmark: cannot run: " + "; ".join(missing), file=sys.stderr)
        return 2
    import torch

    from .report import write_results

    command = recorded_command("kvcache_op.benchmarks.gpu.bench", argv)
    device = torch.cuda.get_device_name()
    print(f"KeyValueCache CUDA benchmark on {device} (torch {torch.__version__})", flush=True)
    print(HEADER, flush=True)
    rows = []
    with torch.cuda.stream(torch.cuda.Stream()):  # one stream, not the legacy default one
        for case in cases(args.quick):
            rows.append(measure(case, args.warmup, args.repeats))
            print(table_line(case, rows[-1]), flush=True)
            torch.cuda.empty_cache()  # the next case allocates its own buffers
    if args.out:
        write_results(rows, args.out, command, device, torch.__version__)
        print(f"wrote {args.out}/results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
