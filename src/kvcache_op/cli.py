"""The ``kvcache-op`` command line: demo, conformance vectors, validation, benchmarks."""

import argparse
import sys


def _conformance(args) -> int:
    from .spec import vectors

    folders = vectors.write_all(args.out, args.case or None, progress=None if args.quiet else print)
    print(f"wrote {len(folders)} conformance case(s) to {args.out}")
    return 0


def _validate(args) -> int:
    from .tools.validate_backend import validate_folder

    return validate_folder(args.dir, args.backend, progress=print)


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo(backend=args.backend, steps=args.steps)


def _bench(args) -> int:
    if args.what == "manager":
        from .tools.bench_manager import main as bench_main
    elif args.what == "attention":
        from .tools.bench_attention import main as bench_main
    else:
        from .tools.bench_kvcache import main as bench_main
    return bench_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcache-op", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="scripted dynamic-batching run through a paged cache")
    demo.add_argument("--backend", choices=("auto", "ort", "reference"), default="auto",
                      help="ort: ONNX Runtime with the custom-op library; reference: onnx ReferenceEvaluator; "
                           "auto: ort when the library is built, else reference (said so in the output)")
    demo.add_argument("--steps", type=int, default=8, help="number of scheduler steps")
    demo.set_defaults(func=_demo)
    conf = sub.add_parser("conformance", help="write the conformance vectors (ONNX backend-test layout)")
    conf.add_argument("--out", required=True, help="output folder")
    conf.add_argument("--case", action="append", help="only this case (repeatable); default: all")
    conf.add_argument("--quiet", action="store_true")
    conf.set_defaults(func=_conformance)
    val = sub.add_parser("validate", help="run conformance vectors through a backend and compare (attention cases "
                                          "within their recorded tolerance)")
    val.add_argument("dir", help="folder written by 'kvcache-op conformance'")
    val.add_argument("--backend", choices=("reference", "ort"), default="reference")
    val.set_defaults(func=_validate)
    bench = sub.add_parser("bench", help="benchmarks: 'bench op [...]', 'bench attention [...]' or 'bench manager [...]' "
                                         "(--help for each)")
    bench.add_argument("what", choices=("op", "attention", "manager"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    """Entry point of ``kvcache-op`` and ``python -m kvcache_op``; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
