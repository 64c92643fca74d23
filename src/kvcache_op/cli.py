"""The ``kvcache-op`` command line: the demo (main job), conformance vectors, validation, benchmarks."""

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

    return run_demo(family=args.family, requests=args.requests, new_tokens=args.new_tokens, num_pages=args.num_pages,
                    quant_bit=args.quant_bit, page_size=args.page_size,
                    providers=args.provider or None, out_dir=args.out, seed=args.seed)


def _slots_demo(args) -> int:
    from .slots_demo import run_slots_demo

    return run_slots_demo(backend=args.backend, steps=args.steps)


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
    demo = sub.add_parser("demo", help="the main job: export a small transformers decoder with the ops, serve requests "
                                       "with continuous batching in ONNX Runtime, verify every token against "
                                       "transformers (needs the 'demo' extra)")
    demo.add_argument("--family", choices=("llama", "mistral", "qwen2"), default="llama")
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--new-tokens", type=int, default=16)
    demo.add_argument("--num-pages", type=int, default=24, help="cache pages (few: evictions and preemptions happen)")
    demo.add_argument("--page-size", type=int, default=16)
    demo.add_argument("--quant-bit", type=int, choices=(0, 4, 8), default=0)
    demo.add_argument("--provider", action="append", help="ONNX Runtime execution provider (repeatable; default: the "
                                                          "CUDA EP when available, else the CPU EP)")
    demo.add_argument("--out", help="folder for the exported model (default: a new temporary folder)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    slots = sub.add_parser("slots-demo", help="a scripted run of the KeyValueCache op alone through a paged cache, "
                                              "printing which slots each step stored and gathered")
    slots.add_argument("--backend", choices=("auto", "ort", "reference"), default="auto",
                       help="ort: ONNX Runtime with the custom-op library; reference: onnx ReferenceEvaluator; "
                            "auto: ort when the library is built, else reference (said so in the output)")
    slots.add_argument("--steps", type=int, default=8, help="number of scheduler steps")
    slots.set_defaults(func=_slots_demo)
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
