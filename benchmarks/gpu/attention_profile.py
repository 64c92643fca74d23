"""Runs one case of the attention CUDA benchmark a few times and nothing else, for a profiler to capture its
kernels (``tools/gpu_check.sh`` with ``GPU_CHECK_PROFILE=1`` runs it under Nsight Compute):

    ncu --clock-control none --kernel-name regex:TileKernel --launch-skip 2 --launch-count 1 \\
        python -m kvcache_op.benchmarks.gpu.attention_profile --case 0

``--case`` indexes :func:`kvcache_op.benchmarks.gpu.attention.cases` (``--list`` prints them).
"""

import argparse
import sys

from ...arguments import OneLineParser, at_least
from .attention import AttentionCall, cases, kernel_route, missing_requirements


def main(argv=None) -> int:
    """0 after ``--calls`` calls of the case (a warm-up first); 2 (one line) where the machine cannot run it."""
    parser = OneLineParser(prog="python -m kvcache_op.benchmarks.gpu.attention_profile", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", type=at_least(0), default=0, help="index into the benchmark's cases")
    parser.add_argument("--calls", type=at_least(1), default=3)
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    every = cases(quick=False)
    if args.list:
        for i, case in enumerate(every):
            print(f"{i}: {case.label()}")
        return 0
    if args.case >= len(every):
        print(f"attention profile: --case must be below {len(every)}, got {args.case}", file=sys.stderr)
        return 2
    missing = missing_requirements()
    if missing:
        print("attention profile: cannot run: " + "; ".join(missing), file=sys.stderr)
        return 2
    import torch

    case = every[args.case]
    with kernel_route(case.kernel), torch.cuda.stream(torch.cuda.Stream()):
        call = AttentionCall(case)  # made on the stream it enqueues on (the one current at construction)
        for _ in range(args.calls):
            call.run_op()
        torch.cuda.current_stream().synchronize()
    print(f"ran {every[args.case].label()} {args.calls} times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
