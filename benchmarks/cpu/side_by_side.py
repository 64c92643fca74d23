"""Side-by-side timing of KeyValueCache variants in one process: the switches the CPU kernels read at each call
(``KVCACHE_OP_*``) and other builds of the library, alternating within every round, each variant's time set
against a plain copy of the same bytes timed right after it, so that a noisy machine's drift falls on every
variant alike. This is how a kernel choice is measured before it is kept.

    python -m kvcache_op.benchmarks.cpu.side_by_side --case decode:paged:0:3 --case decode-p16:paged:0:3 \\
        --variant l1:KVCACHE_OP_HEAD_PREFETCH=l1 --variant l2:KVCACHE_OP_HEAD_PREFETCH=l2 --offsets 0,16 --rounds 9

A case is SHAPE:MODE:QUANT_BIT:LAYOUT: SHAPE one of the CPU benchmark's (decode, prefill, chunk, decode-32h,
decode-p16), decode-<N>h (the decode step's bytes as N heads of 128) or chunk-<N>h (the chunk with N heads of
128), MODE paged or offset, QUANT_BIT 0 or 8.
A variant is NAME[:SETTING,...]; a setting is ENV=VALUE (set while the variant runs; ENV= with no value unsets it)
or library=PATH (the variant runs that build, in its own session on the same inputs; KVCACHE_OP_LIBRARY is read
when a session is made, so a variant names its build this way, not by that variable). Each round runs the variants
in turn, starting one further along each round, so none always runs first. A line per case and output offset
gives each variant's median over the rounds of copy time / op time (its range), its median call time and, after
the first, the median of its time over the first variant's in the same round.
"""

import argparse
import dataclasses
import json
import os
import re
import sys

import numpy as np

from ...arguments import OneLineParser, at_least, library_file, writable_folder_problem
from ..bound_session import aligned_empty
from ..environment import CPU_SWITCHES, environment, recorded_command
from ..kv_shapes import QUICK_SHAPES, SHAPES, Shape, bytes_moved, case_attrs, make_inputs, ort_runner
from ..timing import cpu_device, kernel_build, median_seconds

MODES = {"paged": 1, "offset": 0}


@dataclasses.dataclass(frozen=True)
class Case:
    """One KeyValueCache call to time: a benchmark shape, the cache mode (1 paged, 0 offset), quant_bit, layout."""

    shape: Shape
    cache_mode: int
    quant_bit: int
    layout: int

    @property
    def name(self) -> str:
        """The case as the command line names it."""
        mode = next(k for k, v in MODES.items() if v == self.cache_mode)
        return f"{self.shape.name}:{mode}:{self.quant_bit}:{self.layout}"


@dataclasses.dataclass(frozen=True)
class Variant:
    """A way to run the op: environment settings in force while it runs (None unsets) and the library build."""

    name: str
    env: dict
    library: str | None = None


def shape_named(name: str, quick: bool = False) -> Shape:
    """The benchmark shape called ``name`` (``quick``: the tiny ones), decode-<N>h: 512 head rows a token (the
    decode step's) as N heads of 128, N dividing 512, or chunk-<N>h: the chunk (4 x 256 tokens after 768) with N
    heads of 128, N from 1 to 64. Raises ValueError naming the choices."""
    shapes = QUICK_SHAPES if quick else SHAPES
    for shape in shapes:
        if shape.name == name:
            return shape
    heads = re.fullmatch(r"decode-(\d+)h", name)
    if heads and not quick and int(heads.group(1)) > 0 and 512 % int(heads.group(1)) == 0:
        n = int(heads.group(1))
        return Shape(name, 512 // n, 1, 1023, heads=n)
    heads = re.fullmatch(r"chunk-(\d+)h", name)
    if heads and not quick and 1 <= int(heads.group(1)) <= 64:
        return Shape(name, 4, 256, 768, heads=int(heads.group(1)))
    known = ", ".join(s.name for s in shapes) + ("" if quick else ", decode-<N>h with N dividing 512, chunk-<N>h "
                                                                  "with N from 1 to 64")
    raise ValueError(f"no shape {name!r}{' among the --quick ones' if quick else ''} (shapes: {known})")


def parse_case(text: str) -> tuple:
    """An argparse type: SHAPE:MODE:QUANT_BIT:LAYOUT checked but for the shape's name, which is looked up once
    --quick is known: (shape name, cache mode, quant_bit, layout)."""
    parts = text.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"{text!r} is not SHAPE:MODE:QUANT_BIT:LAYOUT (e.g. decode:paged:8:3)")
    name, mode, quant_bit, layout = parts
    if mode not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: the mode is paged or offset, not {mode!r}")
    if quant_bit not in ("0", "8"):  # the benchmark's inputs: float16 or int8 caches
        raise argparse.ArgumentTypeError(f"{text!r}: quant_bit is 0 or 8, not {quant_bit!r}")
    if layout not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r}: the layout is 0, 1, 2 or 3, not {layout!r}")
    return name, MODES[mode], int(quant_bit), int(layout)


# CPU_SWITCHES: the CPU kernels' switches and what each takes. A value the kernel does not know is ignored there (the
# default runs), so a variant setting one would measure the default under another name: refused here instead.
def switch_problem(key: str, value: str, library) -> str:
    """Why ``key=value`` would not do what it says ('' where it would): a known switch's value it does not take,
    or a ``KVCACHE_OP_`` name no switch of this build has (with ``library=PATH`` anything goes: that build's
    switches are its own)."""
    takes = CPU_SWITCHES.get(key)
    if library is not None or (takes is None and not key.startswith("KVCACHE_OP_")):
        return ""  # another build's switches are its own; other variables are the caller's
    if takes is None:
        return (f"{key} is not a switch of this build's CPU kernels (they read {', '.join(sorted(CPU_SWITCHES))}); "
                "a variant of another build (library=PATH) may set it")
    if isinstance(takes, tuple):
        return "" if value in takes else f"{key} takes {' or '.join(takes)}, not {value!r}"
    return "" if re.fullmatch(r"[0-9]+", value) and int(value) >= takes else \
        f"{key} takes a whole number >= {takes}, not {value!r}"


def parse_variant(text: str) -> Variant:
    """An argparse type: NAME[:SETTING,...] with settings ENV=VALUE (ENV= unsets ENV; not KVCACHE_OP_LIBRARY) or
    library=PATH (an existing file of this binding's C API version), each named once."""
    name, _, settings = text.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise argparse.ArgumentTypeError(f"{text!r}: a variant's name is letters, digits and _.+- (NAME:SETTINGS)")
    env, library = {}, None
    for setting in filter(None, settings.split(",")):
        key, equals, value = setting.partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise argparse.ArgumentTypeError(f"{text!r}: {setting!r} is not ENV=VALUE or library=PATH")
        if key in env or (key == "library" and library is not None):
            raise argparse.ArgumentTypeError(f"{text!r} sets {key} twice")
        if key == "KVCACHE_OP_LIBRARY":
            raise argparse.ArgumentTypeError(f"{text!r}: a variant names its build as library=PATH")
        if key == "library":
            library = checked_library(library_file(value))
        else:
            env[key] = value if value else None
    for key, value in env.items():
        problem = value is not None and switch_problem(key, value, library)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return Variant(name, env, library)


def checked_library(path: str) -> str:
    """``path`` where it loads as a library of this binding's C API version; else an argparse error saying why."""
    from ...capi import c_api

    try:
        c_api.library(path)
    except (OSError, RuntimeError, AttributeError) as error:
        raise argparse.ArgumentTypeError(f"{path} is not a kvcache-op library this binding can use: {error}") from None
    return path


def writable_file_problem(path: str) -> str:
    """Why ``path`` cannot be written as a file, or "": its folder is made where missing and the file opened for
    appending (created empty where it was not there), so that a run never ends, its timing done, on an unwritable
    path."""
    if path.endswith(os.sep) or os.path.isdir(path):
        return f"{path} is a folder"
    folder = os.path.dirname(os.path.abspath(path))
    problem = writable_folder_problem(folder)
    if problem:
        return problem
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as error:
        return f"cannot write {path}: {error.strerror or error}"
    return ""


def measure_rounds(runners: dict, copy, variants: list, rounds: int, warmup: int, repeats: int) -> dict:
    """``rounds`` rounds; in each, every variant in turn (round r starts at variant r mod n) times its runner
    under its settings, then the copy: per variant name, lists over rounds of the op's and the copy's median
    seconds. ``runners``: variant name -> zero-argument call of the op."""
    times = {v.name: {"op": [], "copy": []} for v in variants}
    for r in range(rounds):
        for i in range(len(variants)):
            variant = variants[(r + i) % len(variants)]
            with environment(variant.env):
                times[variant.name]["op"].append(median_seconds(runners[variant.name], warmup, repeats))
            times[variant.name]["copy"].append(median_seconds(copy, warmup, repeats))
    return times


def summarize(times: dict, first: str) -> dict:
    """Per variant: the median and range over rounds of copy time / op time, the op's median ms, and the median
    over rounds of its op time over ``first``'s in the same round."""
    base = np.array(times[first]["op"])
    out = {}
    for name, t in times.items():
        op, copy = np.array(t["op"]), np.array(t["copy"])
        ratio = copy / op
        out[name] = {"vs_copy": float(np.median(ratio)), "vs_copy_range": [float(ratio.min()), float(ratio.max())],
                     "op_ms": float(np.median(op)) * 1e3, "time_vs_first": float(np.median(op / base)),
                     "op_ms_rounds": [x * 1e3 for x in op], "copy_ms_rounds": [x * 1e3 for x in copy]}
    return out


def case_line(case: Case, offset: int, summary: dict, first: str) -> str:
    """The printed line of one case at one output offset."""
    line = f"{case.name} off{offset}:"
    for name, s in summary.items():
        low, high = s["vs_copy_range"]
        line += f"  {name} {s['vs_copy']:.2f}x ({low:.2f}-{high:.2f}, {s['op_ms']:.2f} ms"
        line += ")" if name == first else f", time {s['time_vs_first']:.2f} of {first}'s)"
    return line


def run_case(case: Case, variants: list, offset: int, args) -> dict:
    """One case at one output offset, every variant side by side: sessions of the loaded library shared by every
    variant that names no other build, one session per other build, all on the same inputs."""
    attrs = case_attrs(case.shape, case.quant_bit, case.layout, case.cache_mode)
    inputs = make_inputs(case.shape, case.quant_bit, case.layout, cache_mode=case.cache_mode)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    sessions = {}
    for library in dict.fromkeys(v.library for v in variants):
        sessions[library] = ort_runner(feeds, attrs, args.threads, offset, library=library)
    runners = {v.name: sessions[v.library] for v in variants}
    moved = bytes_moved(case.shape, case.quant_bit)
    src = aligned_empty(moved // 2, np.uint8)
    src.fill(1)
    dst = aligned_empty(moved // 2, np.uint8)
    times = measure_rounds(runners, lambda: np.copyto(dst, src), variants, args.rounds, args.warmup, args.repeats)
    return summarize(times, variants[0].name)


def main(argv=None) -> int:
    """Parses the command line, times every case at every offset with every variant, prints a line each (and,
    given --json, writes every round's times)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", type=parse_case, action="append", required=True,
                        help="SHAPE:MODE:QUANT_BIT:LAYOUT, e.g. decode:paged:8:3 (repeat for more)")
    parser.add_argument("--variant", type=parse_variant, action="append", required=True,
                        help="NAME[:ENV=VALUE,...|library=PATH] (repeat; the others are timed against the first)")
    parser.add_argument("--offsets", default="0", help="comma-separated bytes past a cache line the outputs start at "
                                                         "(0: where ONNX Runtime allocates them; numpy's: 16)")
    parser.add_argument("--rounds", type=at_least(1), default=7)
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--repeats", type=at_least(1), default=9, help="timed calls per measurement (their median)")
    parser.add_argument("--threads", type=at_least(1), default=1, help="intra_op_num_threads")
    parser.add_argument("--json", help="file to write every round's times to")
    parser.add_argument("--quick", action="store_true", help="the tiny shapes: checks the tool runs, measures nothing")
    args = parser.parse_args(argv)
    try:
        offsets = [int(x) for x in args.offsets.split(",")]
    except ValueError:
        parser.error(f"--offsets: {args.offsets!r} is not a comma-separated list of integers")
    if any(not 0 <= x < 64 or x % 2 for x in offsets):
        parser.error(f"--offsets: each is an even number of bytes below 64 (float16 outputs), got {args.offsets}")
    if args.json:
        json_problem = writable_file_problem(args.json)
        if json_problem:
            parser.error(f"--json: {json_problem}")
    names = [v.name for v in args.variant]
    if len(set(names)) != len(names):
        parser.error(f"--variant: names must differ, got {', '.join(names)}")
    try:
        cases = [Case(shape_named(name, args.quick), mode, qb, layout) for name, mode, qb, layout in args.case]
    except ValueError as error:
        parser.error(f"--case: {error}")
    # Settings that change what runs for every variant: the op's switches and build, BLAS threads on the cores.
    command = recorded_command("kvcache_op.benchmarks.cpu.side_by_side", argv)
    print(f"{cpu_device()}, {args.threads} thread(s), {args.rounds} rounds of {args.repeats} calls", flush=True)
    builds = {}
    for v in args.variant:
        with environment(v.env):  # the build and choices this variant runs, under its settings
            builds[v.name] = kernel_build(v.library).lstrip(", ")
        settings = [f"{k}={'' if x is None else x}" for k, x in v.env.items()]
        settings += [f"library={v.library}"] * bool(v.library)
        print(f"  {v.name}: {', '.join(settings) or 'as the environment is'}: {builds[v.name]}", flush=True)
    results = []
    for case in cases:
        for offset in offsets:
            summary = run_case(case, args.variant, offset, args)
            print(case_line(case, offset, summary, names[0]), flush=True)
            results.append({"case": case.name, "output_offset": offset, "variants": summary})
    if args.json:
        record = {"command": command, "device": cpu_device(), "rounds": args.rounds, "repeats": args.repeats,
                  "variants": {v.name: {"env": v.env, "library": v.library, "build": builds[v.name]}
                               for v in args.variant},
                  "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
