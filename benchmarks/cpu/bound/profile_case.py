"""Runs one case of the CPU benchmark (kvcache_op.benchmarks.cpu.bench) over and over, on one thread, for a
sampling profiler to attribute its time. From the repository root:

    perf record -o /tmp/case.data python benchmarks/cpu/bound/profile_case.py --shape prefill --layout 3
    perf report -i /tmp/case.data --stdio -n --sort sym

The installed library is stripped; for function names, point KVCACHE_OP_LIBRARY at a build with symbols
(cmake -S . -B /tmp/kvbuild -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g && ninja -C /tmp/kvbuild).
Setting the case up (random inputs) shows in the profile too: compare the kernel's functions, not totals.
"""

import argparse
import time

from kvcache_op.benchmarks.kv_shapes import SHAPES, case_attrs, make_inputs, ort_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s.name for s in SHAPES], default="prefill")
    parser.add_argument("--cache-mode", type=int, choices=[0, 1], default=1, help="0 offset, 1 paged")
    parser.add_argument("--quant-bit", type=int, choices=[0, 4, 8], default=8)
    parser.add_argument("--layout", type=int, choices=[0, 1, 2, 3], default=0)
    parser.add_argument("--output-offset", type=int, default=0,
                        help="bytes past a cache line the outputs start at (0: where ONNX Runtime places them)")
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    shape = next(s for s in SHAPES if s.name == args.shape)
    attrs = case_attrs(shape, args.quant_bit, args.layout, args.cache_mode)
    inputs = make_inputs(shape, args.quant_bit, args.layout, cache_mode=args.cache_mode)
    run = ort_runner({k: v for k, v in inputs.items() if v is not None}, attrs, 1, args.output_offset)
    for _ in range(3):
        run()
    start = time.perf_counter()
    for _ in range(args.calls):
        run()
    print(f"{args.shape} cache_mode={args.cache_mode} quant_bit={args.quant_bit} layout={args.layout} "
          f"output_offset={args.output_offset}: "
          f"{(time.perf_counter() - start) / args.calls * 1e3:.3f} ms per call ({args.calls} calls)")


if __name__ == "__main__":
    main()
