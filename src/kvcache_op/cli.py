"""The ``kvcache-op`` command line: the demo (main job), export of a checkpoint folder, conformance vectors,
validation and fuzzing of backends, benchmarks."""

import argparse
import os
import sys

from . import __version__
from .extras import install_hint, missing_optional_module
from .arguments import (MAX_PAGE_SIZE, OneLineParser, absolute_path, at_least, positive_seconds,
                        writable_folder_problem)


DEFAULT_TIMEOUT = 300.0  # seconds a backend's worker may take to load, and each call


def _conformance(args) -> int:
    from .validation import vectors

    if args.list:
        if args.out:
            return _fail("conformance", "--list prints the cases, --out writes them: give one")
        try:
            wanted = set(vectors.resolve_names(args.case or ()))
        except ValueError as error:
            return _fail("conformance", str(error))
        for name, make in vectors.ALL_CASES.items():
            if not wanted or name in wanted:
                case = make()
                print(f"{name:<48} {case.op:<22} {'invalid' if case.expect_error else 'valid'}")
        return 0
    if not args.out:
        return _fail("conformance", "--out DIR is required (or --list)")
    try:
        folders = vectors.write_conformance(args.out, args.case or None, progress=None if args.quiet else print)
    except ValueError as error:
        return _fail("conformance", str(error))
    except BrokenPipeError:
        raise  # the reader of its progress went away, not the folder: main ends quietly
    except OSError as error:
        return _fail("conformance", f"cannot write {args.out}: {error.strerror or error}")
    print(f"wrote {len(folders)} conformance case(s) to {args.out}")
    return 0


def _export(args) -> int:
    from .export_command import export_checkpoint

    try:
        export_checkpoint(args.checkpoint, args.out, page_size=args.page_size, quant_bit=args.quant_bit,
                          dtype=args.dtype, cache_layout=args.cache_layout,
                          fused_attention=not args.split_attention)
    except BrokenPipeError:
        raise  # the reader of its progress went away: main ends quietly
    except (OSError, ValueError) as error:  # OSError: transformers' word for a checkpoint it cannot load, or a write
        return _fail("export", str(error))
    return 0


def _serve(args) -> int:
    from .serve_command import serve

    try:
        return serve(args)
    except BrokenPipeError:
        raise  # the reader of its output went away: main ends quietly
    except (FileNotFoundError, ValueError, OSError) as error:
        return _fail("serve", str(error))


def _fail(command: str, message: str) -> int:
    """One line on stderr, exit status 2: what a bad argument (case name, library path, backend) gets."""
    print(f"kvcache-op {command}: error: {message}", file=sys.stderr)
    return 2


def _provider_options(pairs) -> dict:
    options = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--provider-option {pair!r}: expected KEY=VALUE")
        options[key] = value
    return options


def _backend_options(args) -> dict:
    """The backend keywords of ``validate``/``fuzz``; ``ValueError`` for a ``--timeout`` that could not be kept (a
    backend in this process cannot be stopped in the middle of a call)."""
    in_process = args.isolate is False or (args.isolate is None and args.backend == "reference")
    if args.timeout is not None and in_process:
        raise ValueError("--timeout needs the backend in a worker process (--isolate): one in this process cannot "
                         "be stopped in the middle of a call")
    return dict(ort_library=args.ort_library, provider=args.provider, provider_options=_provider_options(args.provider_option),
                isolate=args.isolate, timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout)


def _validate(args) -> int:
    from .validation import BackendLoadError, CaseSelectionError, list_cases, validate_folder

    try:
        if args.list:
            for name, op, kind in list_cases(args.dir, args.case):
                print(f"{name:<48} {op:<22} {kind}")
            return 0
        return validate_folder(args.dir, args.backend, progress=print, tolerance=args.tolerance, cases=args.case,
                               **_backend_options(args))
    except (BackendLoadError, CaseSelectionError, ValueError) as error:
        return _fail("validate", str(error))


def _fuzz(args) -> int:
    from .validation import BackendLoadError, run_fuzz

    kinds = ("valid", "invalid") if args.calls == "both" else (args.calls,)
    problem = writable_folder_problem(args.out)
    if problem:
        return _fail("fuzz", f"--out {args.out}: {problem}")
    try:
        return run_fuzz(args.backend, examples=args.examples, seed=args.seed, ops=args.op, kinds=kinds,
                        tolerance=args.tolerance, out=args.out, progress=print, **_backend_options(args))
    except (BackendLoadError, ValueError) as error:
        return _fail("fuzz", str(error))


def _add_backend_arguments(parser) -> None:
    parser.add_argument("--backend", default="reference",
                        help="reference (the numpy reference), ort (ONNX Runtime with a custom-op library), or "
                             "module:function (a Python callable with the reference's signature, importable from "
                             "the current directory or PYTHONPATH; module:object for an object with "
                             "key_value_cache / multi_head_attention / key_cache_rotary_shift / "
                             "multi_head_cache_attention)")
    parser.add_argument("--ort-library", metavar="PATH", type=absolute_path,
                        help="with --backend ort: the custom-op library to register (default: this package's)")
    parser.add_argument("--provider", metavar="NAME", help="with --backend ort: the execution provider "
                                                           "(default CPUExecutionProvider; inputs bound on its device)")
    parser.add_argument("--provider-option", metavar="KEY=VALUE", action="append", help="an option of the provider "
                                                                                         "(repeatable)")
    parser.add_argument("--tolerance", choices=("exact", "spec"), default="exact",
                        help="exact: bit for bit (default); spec: the tolerance table of spec/KeyValueCache.md")
    isolation = parser.add_mutually_exclusive_group()
    isolation.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                           help="run the backend in a worker process, so a crash fails only its case "
                                "(default for ort and module:function)")
    isolation.add_argument("--in-process", dest="isolate", action="store_false",
                           help="run the backend in this process (faster; a crash ends the run)")
    parser.add_argument("--timeout", type=positive_seconds,
                        help=f"seconds the worker may take to load the backend, and each call (default "
                             f"{DEFAULT_TIMEOUT:g}; needs a worker: --isolate)")


def _demo(args) -> int:
    from .demo import run_demo

    if args.out:
        problem = writable_folder_problem(args.out)
        if problem:
            return _fail("demo", f"--out {args.out}: {problem}")
    if args.provider:
        import onnxruntime

        missing = [p for p in args.provider if p not in onnxruntime.get_available_providers()]
        if missing:
            return _fail("demo", f"--provider {', '.join(missing)}: not in this onnxruntime (it has "
                                 f"{', '.join(onnxruntime.get_available_providers())}; the CUDA EP needs onnxruntime-gpu)")
        from .serving.ort_runner import provider_device

        try:  # before the export: the engine keeps its cache on the first provider's device
            provider_device(args.provider)
        except ValueError as error:
            return _fail("demo", f"--provider {args.provider[0]}: {error}")

    return run_demo(family=args.family, requests=args.requests, new_tokens=args.new_tokens, num_pages=args.num_pages,
                    quant_bit=args.quant_bit, page_size=args.page_size,
                    providers=args.provider or None, out_dir=args.out, seed=args.seed)


def _slots_demo(args) -> int:
    from .slots_demo import run_slots_demo

    try:
        return run_slots_demo(backend=args.backend, steps=args.steps)
    except ValueError as error:
        return _fail("slots-demo", str(error))


def _bench(args) -> int:
    rest = list(args.rest)
    if args.what == "manager":
        from .benchmarks.manager.bench import main as bench_main
    elif args.what == "attention":
        from .benchmarks.attention.bench import main as bench_main
    else:
        try:
            cuda = _take_cuda_device(rest)
        except ValueError as error:
            return _fail("bench op", str(error))
        if cuda:
            from .benchmarks.gpu.bench import main as bench_main
        else:
            from .benchmarks.cpu.bench import main as bench_main
    return bench_main(rest, prog=f"kvcache-op bench {args.what}")  # its errors name the subcommand


def _take_cuda_device(rest: list) -> bool:
    """True when ``rest`` asks for ``--device cuda``. ``--device cpu`` or ``cuda`` is removed from ``rest`` (each
    benchmark measures one device); ``ValueError`` for any other value, or none."""
    for i, arg in enumerate(rest):
        if arg.startswith("--device="):
            value, width = arg.partition("=")[2], 1
        elif arg == "--device":
            value, width = (rest[i + 1] if i + 1 < len(rest) else None), 2
        else:
            continue
        if value not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {value!r}" if value is not None else
                             "--device needs a value: cpu or cuda")
        del rest[i:i + width]
        return value == "cuda"
    return False


# kvcache_op.hf.tiny.FAMILY_DEFAULTS' keys, listed here so that building the parser imports no torch.
DEMO_FAMILIES = ("gemma", "gemma2", "gemma3_text", "gpt_neox", "granite", "llama", "mistral", "mixtral", "olmo2", "phi3",
                 "qwen2", "qwen3", "qwen3_moe", "stablelm")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvcache-op", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvcache-op {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main job: export a small transformers decoder with the ops, serve requests "
                                       "with continuous batching in ONNX Runtime, verify every token against "
                                       "transformers (needs the 'demo' extra)")
    demo.add_argument("--family", choices=DEMO_FAMILIES, default="llama", help="the tiny decoder's family (default llama)")
    demo.add_argument("--requests", type=at_least(1), default=32)
    demo.add_argument("--new-tokens", type=at_least(1), default=16)
    demo.add_argument("--num-pages", type=at_least(1), default=24,
                      help="cache pages (few: cached prefixes are evicted)")
    demo.add_argument("--page-size", type=at_least(1, MAX_PAGE_SIZE), default=16)
    demo.add_argument("--quant-bit", type=int, choices=(0, 4, 8), default=0)
    demo.add_argument("--provider", action="append", help="ONNX Runtime execution provider (repeatable; default: the "
                                                          "CUDA EP when available, else the CPU EP)")
    demo.add_argument("--out", help="folder that keeps the exported model (default: a temporary folder, removed at the end)")
    demo.add_argument("--seed", type=at_least(0), default=0)
    demo.set_defaults(func=_demo)
    export = sub.add_parser("export", help="export a local transformers checkpoint folder to the packed decoder graph "
                                           "the engine serves, its tokenizer files copied beside it (needs the 'hf' "
                                           "extra)")
    export.add_argument("checkpoint", help="a folder with config.json and the weights (save_pretrained's layout)")
    export.add_argument("out", help="the ONNX file to write (its tokenizer files go to OUT.tokenizer/ beside it)")
    export.add_argument("--page-size", type=at_least(1, MAX_PAGE_SIZE), default=16,
                        help=f"cache page size in tokens (default 16, at most {MAX_PAGE_SIZE})")
    export.add_argument("--quant-bit", type=int, choices=(0, 4, 8), default=0, help="cache quantization (default 0)")
    export.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        help="the cache's and attention's element type (default: the model's, float32)")
    export.add_argument("--cache-layout", type=int, choices=(0, 1, 2, 3), default=1, help="cache layout (default 1)")
    export.add_argument("--split-attention", action="store_true",
                        help="KeyValueCache then MultiHeadAttention per layer instead of MultiHeadCacheAttention")
    export.set_defaults(func=_export)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics) for "
                                         "an exported file or a checkpoint folder (needs the 'serve' extra)")
    serve.add_argument("model", help="an exported .onnx file, or a checkpoint folder (exported once into --cache-dir)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)")
    serve.add_argument("--port", type=at_least(0, 65535), default=8000, help="port (default 8000; 0: a free one)")
    serve.add_argument("--allow-remote", action="store_true", help="allow a --host that is not loopback")
    serve.add_argument("--num-pages", type=at_least(1), default=512, help="cache pages (default 512)")
    serve.add_argument("--tokenizer", help="tokenizer folder (default: beside the file, or the checkpoint's)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                                         "and /metrics (default: "
                                         "$KVCACHE_OP_API_KEY, else none)")
    serve.add_argument("--model-name", help="the model id clients send (default: the file or folder name)")
    serve.add_argument("--max-queue", type=at_least(0), default=256,
                       help="requests waiting for admission beyond the free running slots before new ones get 503 "
                            "(default 256; 0: only what can start running at once)")
    serve.add_argument("--max-body-bytes", type=at_least(1), default=1 << 20, help="request body limit (1 MiB)")
    serve.add_argument("--max-prompt-tokens", type=at_least(1), help="prompt limit (default: the context)")
    serve.add_argument("--max-tokens-limit", type=at_least(1), default=4096, help="largest max_tokens (4096)")
    serve.add_argument("--max-batch-tokens", type=at_least(1), help="tokens fed per engine step (default 256 on the CPU, "
                                                                   "8192 on a GPU)")
    serve.add_argument("--max-running", type=at_least(1), help="requests in flight at once (default 64)")
    serve.add_argument("--threads", type=at_least(0), default=0, help="ONNX Runtime intra-op threads (0: its default; "
                                                                      "at most four per core)")
    serve.add_argument("--decode-steps", type=at_least(1), help="decode steps planned at once while every running "
                                                                 "request only decodes (default 64; a new request or "
                                                                 "a cancellation ends a run at its next step; 1: one "
                                                                 "at a time)")
    serve.add_argument("--page-size", type=at_least(1, MAX_PAGE_SIZE),
                       help="for a checkpoint folder: page size (default 16)")
    serve.add_argument("--quant-bit", type=int, choices=(0, 4, 8), help="for a checkpoint folder: "
                                                                       "cache quantization (default 0)")
    serve.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), help="for a checkpoint folder: the "
                                                                                   "cache's element type")
    serve.add_argument("--cache-dir", help="where checkpoint folders are exported (default $KVCACHE_OP_CACHE or "
                                           "~/.cache/kvcache-op)")
    serve.add_argument("--replicas", type=at_least(1), help="run as N Ray Serve replicas, each with its own engine "
                                                           "(needs the 'ray' extra)")
    serve.add_argument("--stop-after", type=positive_seconds, help="stop by itself after this many seconds")
    serve.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(func=_serve)
    slots = sub.add_parser("slots-demo", help="a scripted run of the KeyValueCache op alone through a paged cache, "
                                              "printing which slots each step stored and gathered")
    slots.add_argument("--backend", choices=("auto", "ort", "reference"), default="auto",
                       help="ort: ONNX Runtime with the custom-op library; reference: onnx ReferenceEvaluator; "
                            "auto: ort when the library is built, else reference (said so in the output)")
    slots.add_argument("--steps", type=at_least(1), default=8, help="number of scheduler steps")
    slots.set_defaults(func=_slots_demo)
    conf = sub.add_parser("conformance", help="write the conformance vectors (ONNX backend-test layout): valid and "
                                              "invalid calls of the four ops")
    conf.add_argument("--out", help="output folder")
    conf.add_argument("--case", action="append", help="only this case (repeatable); default: all")
    conf.add_argument("--list", action="store_true", help="list the named cases (name, op, valid/invalid)")
    conf.add_argument("--quiet", action="store_true")
    conf.set_defaults(func=_conformance)
    val = sub.add_parser("validate", help="run conformance vectors through a backend and say what differs (attention "
                                          "within each case's recorded tolerance)")
    val.add_argument("dir", help="folder written by 'kvcache-op conformance'")
    _add_backend_arguments(val)
    val.add_argument("--case", action="append", metavar="NAME",
                     help="only this case (repeatable; shell patterns such as 'mha_*' allowed)")
    val.add_argument("--list", action="store_true", help="list the cases in DIR (name, op, valid/invalid) and exit")
    val.set_defaults(func=_validate)
    fuzz = sub.add_parser("fuzz", help="differential fuzzing of a backend against the reference; a disagreement is "
                                       "shrunk and written as a reproducer")
    _add_backend_arguments(fuzz)
    fuzz.add_argument("--examples", type=at_least(1), default=200, help="calls to draw (default 200)")
    fuzz.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    fuzz.add_argument("--op", action="append", choices=("kv", "rotary", "attention", "cache-attention"),
                      help="only this op (repeatable; default: every op the backend provides)")
    fuzz.add_argument("--calls", choices=("valid", "invalid", "both"), default="both", help="which calls to draw")
    fuzz.add_argument("--out", default="fuzz-reproducer", help="where a reproducer is written (default ./fuzz-reproducer)")
    fuzz.set_defaults(func=_fuzz)
    bench = sub.add_parser("bench", help="benchmarks: 'bench op [--device cpu|cuda] [...]', 'bench attention [...]' "
                                         "or 'bench manager [...]' (--help for each)")
    bench.add_argument("what", choices=("op", "attention", "manager"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    bench.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    """Entry point of ``kvcache-op`` and ``python -m kvcache_op``; returns the exit status. A command that misses
    an optional module says in one line which extra brings it (exit status 2); one whose reader has gone (``| head``)
    ends quietly with status 1."""
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
        if sys.stdout is not None:  # None: started with stdout closed
            sys.stdout.flush()  # here, where a reader that has gone is handled, not at exit
        return status
    except ImportError as error:
        missing = missing_optional_module(error)
        if missing is None:
            raise
        return _fail(args.command, install_hint(missing, args.command))
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, the status a shell gives an interrupted command
        print(f"kvcache-op {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Points the process's own stdout at /dev/null after its reader has gone (Python's advice), or the flush at
    exit fails again; a stdout that is not the process's (a caller's capture) is left as it is."""
    if sys.stdout is None or sys.stdout is not sys.__stdout__:
        return
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
