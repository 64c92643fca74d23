"""The side-by-side checks each CPU kind still owes: kernel choices measured on one kind of processor that reach
other kinds unmeasured (each kind's folder under benchmarks/cpu says which). One command runs every check this
machine's kind owes, through the side-by-side tool (the kernel's own choice first, then the settings measured
elsewhere, each against a copy of the same bytes and against the first), and writes each check's rounds into a
folder:

    OPENBLAS_NUM_THREADS=1 python -m kvcache_op.benchmarks.cpu.pending --out /tmp/pending
    python -m kvcache_op.benchmarks.cpu.pending --list [--kind intel-xeon-207]
    python -m kvcache_op.benchmarks.cpu.pending --check head-prefetch-l2 --out /tmp/pending   # one, owed or not

A kind is named as its folder is: intel-xeon-<model> for an Intel processor of family 6, amd-epyc-zen3,
amd-epyc-zen4 or amd-epyc (Zen 5) for AMD's; another Intel or AMD processor (Zen 6, an Intel family other than
6) is no kind yet and owes every check of its vendor, as intel-xeon-unnamed or amd-epyc-unnamed. --list also
names what a kind's run owes that no check can time (other builds, the standard benchmark, the traffic programs).
A check owed by a kind is timed on that kind only, with no KVCACHE_OP_ choice switch set in the shell. Once a
check's figures are in the kind's README (and the kernel's choice is kept or changed by them), the kind goes into
the check's ``measured_on``.
"""

import argparse
import dataclasses
import fnmatch
import os
import re
import sys

from ...arguments import OneLineParser, at_least, out_folder
from ..kv_shapes import QUICK_SHAPES
from ..timing import cpu_device, cpuinfo_fields
from . import side_by_side

#: The switches of the CPU kernels' choices (read at each call, but the build's at load): none may be set in the
#: shell that runs the checks, whose first variant is the kernel's own choice on this processor.
CHOICE_SWITCHES = ("KVCACHE_OP_STORES", "KVCACHE_OP_CACHED_GATHER", "KVCACHE_OP_STREAMED_HEADS",
                   "KVCACHE_OP_GATHER_TILE", "KVCACHE_OP_TOKEN_STREAMS", "KVCACHE_OP_TOKEN_PREFETCH",
                   "KVCACHE_OP_CODE_STORES", "KVCACHE_OP_HEAD_PREFETCH", "KVCACHE_OP_CPU_VENDOR",
                   "KVCACHE_OP_CPU_KERNEL")


@dataclasses.dataclass(frozen=True)
class Check:
    """A kernel choice owed a side-by-side measurement: the kinds that owe it (folder-name patterns) less those
    measured, the kernel builds whose code it times, the cases and the variants (NAME:ENV=VALUE,...; the first,
    with no setting, the kernel's own choice), and why."""

    name: str
    owed_by: tuple
    measured_on: tuple
    builds: tuple
    cases: tuple
    variants: tuple
    why: str
    offsets: str = "0,16"

    def owed(self, kind: str) -> bool:
        """Whether a processor of ``kind`` owes this check."""
        return kind not in self.measured_on and any(fnmatch.fnmatch(kind, p) for p in self.owed_by)


def _cases(shapes, quant_bit: int, layouts) -> tuple:
    return tuple(f"{shape}:paged:{quant_bit}:{layout}" for shape in shapes for layout in layouts)


AVX512 = ("avx512",)
EVERY_BUILD = ("avx512", "avx2", "generic")
CHECKS = (
    Check("head-prefetch-l2", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), EVERY_BUILD,
          _cases(("decode", "decode-32h", "decode-p16"), 0, (3,)),
          ("own", "l2:KVCACHE_OP_HEAD_PREFETCH=l2"),
          "layout 3's float16 head rows asked for into the second-level cache: on the Zen 4 (amd-epyc-zen4, eight "
          "heads' rows filling an 8-way set) decode 0.99x -> 1.33x a copy, decode-p16 0.84-0.89x -> 1.02-1.17x; "
          "Intel processors keep the first level (the second took 0.99-1.05x its time on model 207, 1.01-1.02x on 167)"),
    Check("head-prefetch-l1", ("amd-epyc*",), ("amd-epyc-zen4", "amd-epyc-zen3"), EVERY_BUILD,
          _cases(("decode", "decode-32h", "decode-p16"), 0, (3,)),
          ("own", "l1:KVCACHE_OP_HEAD_PREFETCH=l1"),
          "every AMD processor takes the Zen 4's second-level head prefetch (kept on the Zen 3: the first level "
          "0.95-1.12x its time); Zen 5 (12-way 48 KiB first level) takes it unmeasured"),
    Check("token-streams", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("decode", "decode-32h", "decode-p16"), 0, (0, 1, 2)),
          ("own", "one:KVCACHE_OP_TOKEN_STREAMS=1", "sixteen:KVCACHE_OP_TOKEN_STREAMS=16"),
          "token-order float16 gathers read a task's rows as runs side by side: 0.81-0.91x -> 1.03-1.14x a copy "
          "on model 167 (intel-xeon-167, \"Token streams\")"),
    Check("token-prefetch", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("decode-32h", "chunk-32h"), 8, (0, 1, 2)),  # 32 heads: rows of 4 KiB (1 KiB rows go whole)
          ("own", "whole-rows:KVCACHE_OP_TOKEN_PREFETCH=0"),
          "quantized token-order gathers ask for a token's first kilobyte ahead, not its whole row: int8 "
          "decode-32h 0.73-0.77x -> 0.85-0.90x on model 167 (intel-xeon-167, \"Token prefetch\")"),
    Check("streamed-heads-int8", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("decode", "decode-32h", "decode-p16"), 8, (3,)),
          ("own", "four:KVCACHE_OP_STREAMED_HEADS=4"),
          "layout 3's streamed int8 rows read eight heads side by side on Intel processors, where they read four: "
          "0.68-0.69x -> 0.76x 16 bytes past a line on model 167"),
    Check("streamed-heads-float16", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("decode", "decode-32h"), 0, (3,)),
          ("own", "four:KVCACHE_OP_STREAMED_HEADS=4", "sixteen:KVCACHE_OP_STREAMED_HEADS=16"),
          "layout 3's streamed float16 gathers walk a page run eight heads a pass, where they went token by token "
          "(on the Zen 4 decode-32h 0.43-0.48x -> 0.97-1.00x a copy); with 8 heads, 16 is every head a pass"),
    Check("code-stores", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("prefill", "chunk"), 8, (0, 1, 2, 3)),
          ("own", "cached:KVCACHE_OP_CODE_STORES=cached"),
          "quantized codes (and layout 3's scale rows) stored with streaming stores on every processor: layout 3's "
          "int8 prefill 2.02 -> 1.46 ms on model 167, 2.44 -> 2.13 ms on the Zen 4"),
    Check("gather-tiles", ("intel-xeon-*",), ("intel-xeon-167", "intel-xeon-207"), AVX512,
          _cases(("decode", "decode-32h"), 8, (2,)) + _cases(("chunk",), 0, (2,)),
          ("own", "token:KVCACHE_OP_GATHER_TILE=0", "32k:KVCACHE_OP_GATHER_TILE=32768",
           "512k:KVCACHE_OP_GATHER_TILE=524288"),
          "layout 2's token-order gathers on Intel processors write 32 KiB tiles of unquantized rows (AMD's 512 KiB) "
          "and quantized rows a token at a time (int8 decode on lines 0.89-0.95x -> 0.96-0.98x a copy on models 207 "
          "and 167; "
          "on the Zen 4 int8 decode-32h 0.84x a token at a time, 0.98x in 512 KiB tiles); float16 decode reads token "
          "streams instead, so float16 is timed on the chunk, whose outputs stay cached"),
)

#: What a kind's next run owes that these checks cannot time: another build against this one, or a program
#: outside the op. Printed with --list so that a run on that kind does not stop at this command.
NOT_COVERED = (
    "the standard benchmark, on lines and 16 bytes past (--output-offset 16): python -m "
    "kvcache_op.benchmarks.cpu.bench --out benchmarks/cpu/<kind> (the dword permute's figures, LineCut, have no "
    "switch: they are set against the kind's run before)",
    "builds before a change against this one (layout 3's page runs; the prefetch of every head-order pass): "
    "--variant NAME:library=PATH with the side-by-side tool, the builds named in the kind's README",
    "the traffic alone: benchmarks/cpu/bound/token_runs.cc and scale_rows.cc (their README says how to build them)",
)


def cpu_kind(cpuinfo: str = None) -> str:
    """This processor's kind as its benchmark folder names it (see the module's docstring), from
    ``/proc/cpuinfo``'s first processor; "" where it is none of those (another vendor, family or machine)."""
    fields = cpuinfo_fields(cpuinfo)
    try:
        family, model = int(fields.get("cpu family", "")), int(fields.get("model", ""))
    except ValueError:
        return ""
    vendor = fields.get("vendor_id")
    if vendor == "GenuineIntel" and family == 6:
        return f"intel-xeon-{model}"
    if vendor == "AuthenticAMD":  # the models of each generation as Linux's arch/x86/kernel/cpu/amd.c groups them
        generations = {25: (("amd-epyc-zen3", (0x00, 0x0F), (0x20, 0x5F)),
                            ("amd-epyc-zen4", (0x10, 0x1F), (0x60, 0xAF))),
                       26: (("amd-epyc", (0x00, 0x2F), (0x40, 0x4F), (0x60, 0x7F)),)}  # Zen 5; Zen 6 is none of these
        for kind, *ranges in generations.get(family, ()):
            if any(low <= model <= high for low, high in ranges):
                return kind
    return ""


#: The stand-in kind of an Intel or AMD processor no folder names yet: it owes every check of its vendor (the
#: kernel runs the vendor's choices on it unmeasured) and needs a folder of its own.
UNNAMED = {"GenuineIntel": "intel-xeon-unnamed", "AuthenticAMD": "amd-epyc-unnamed"}
KIND_NAMES = re.compile(r"intel-xeon-(\d+|unnamed)|amd-epyc(-zen3|-zen4|-unnamed)?")


def owing_kind(cpuinfo: str = None) -> str:
    """The kind whose checks this processor owes: :func:`cpu_kind`, or for an Intel or AMD processor of no named
    kind its vendor's stand-in (:data:`UNNAMED`); "" for another vendor or machine (the checks time x86 choices)."""
    return cpu_kind(cpuinfo) or UNNAMED.get(cpuinfo_fields(cpuinfo).get("vendor_id"), "")


def quick_case(case: str) -> str:
    """``case`` with a tiny shape: its own where --quick has one, else the tiny decode."""
    shape, _, rest = case.partition(":")
    return case if any(s.name == shape for s in QUICK_SHAPES) else f"decode:{rest}"


def side_by_side_arguments(check: Check, out: str, rounds: int, quick: bool) -> list:
    """The side-by-side tool's command line for ``check``, its rounds written to ``out``/<check>.json."""
    cases = [quick_case(c) for c in check.cases] if quick else list(check.cases)
    arguments = [a for c in dict.fromkeys(cases) for a in ("--case", c)]
    arguments += [a for v in check.variants for a in ("--variant", v)]
    arguments += ["--offsets", check.offsets, "--rounds", str(rounds)]
    arguments += ["--json", os.path.join(out, f"{check.name}.json")]
    return arguments + ["--quick"] * quick


def describe(check: Check, kind: str) -> str:
    """A check in words: its name, whether ``kind`` owes it, why it is owed, its cases and variants."""
    owed = "owed" if check.owed(kind) else "not owed"
    return (f"{check.name} ({owed} by {kind or 'this unnamed kind'}; owed by {', '.join(check.owed_by)}"
            f"{' except ' + ', '.join(check.measured_on) if check.measured_on else ''}; {'/'.join(check.builds)} "
            f"builds): {check.why}\n    cases {' '.join(check.cases)}\n    variants {' '.join(check.variants)}")


def main(argv=None) -> int:
    """Lists the checks (--list) or runs those this machine's kind owes (or those named by --check) through the
    side-by-side tool, a JSON file each in --out; a check whose build is not the one loaded is passed over, said."""
    from ...capi import c_api

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the checks and which the kind owes; time nothing")
    parser.add_argument("--kind", help="with --list: the kind to list for (default this machine's)")
    parser.add_argument("--check", action="append", choices=[c.name for c in CHECKS],
                        help="run this check whether or not the kind owes it (repeat for more)")
    parser.add_argument("--out", type=out_folder, help="folder for each check's rounds (<check>.json)")
    parser.add_argument("--rounds", type=at_least(1), default=11)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round: checks the command runs")
    args = parser.parse_args(argv)
    if args.kind is not None and not KIND_NAMES.fullmatch(args.kind):
        parser.error(f"--kind {args.kind!r}: a kind is intel-xeon-<model>, amd-epyc-zen3, amd-epyc-zen4, amd-epyc "
                     "or the vendor's stand-in intel-xeon-unnamed / amd-epyc-unnamed")
    kind = args.kind if args.kind is not None else owing_kind()
    if kind in UNNAMED.values():
        print(f"this processor ({cpu_device()}) is no named kind: it owes every check of its vendor, and its results "
              "need a folder of their own under benchmarks/cpu (named in pending.cpu_kind)", flush=True)
    if args.list:
        for check in CHECKS:
            print(describe(check, kind))
        print("not timed by these checks, and owed by a kind's run all the same:")
        for item in NOT_COVERED:
            print(f"    {item}")
        return 0
    if args.kind is not None:
        parser.error("--kind names the kind to list for: a kind's checks are timed on that kind, without --kind")
    if not args.out:
        parser.error("--out is required to run checks (a folder for their rounds)")
    set_switches = [k for k in CHOICE_SWITCHES if k in os.environ]
    if set_switches:
        parser.error(f"unset {', '.join(set_switches)}: each check's first variant is the kernel's own choice on "
                     "this processor, in the build it loads")
    checks = [c for c in CHECKS if c.name in args.check] if args.check else [c for c in CHECKS if c.owed(kind)]
    if not checks:
        print(f"this processor's kind ({kind or 'unnamed: ' + cpu_device()}) owes no check; "
              "--list shows them all")
        return 0
    build = c_api.cpu_kernel()
    rounds = 1 if args.quick else args.rounds
    ran = []
    for check in checks:
        print(f"== {describe(check, kind)}", flush=True)
        if build not in check.builds:
            print(f"   passed over: it times the {'/'.join(check.builds)} build, and the {build} build is loaded",
                  flush=True)
            continue
        status = side_by_side.main(side_by_side_arguments(check, args.out, rounds, args.quick))
        if status:
            return status
        ran.append(check.name)
    print(f"ran {len(ran)} of {len(checks)} check(s) into {args.out}: {', '.join(ran) or 'none'}")
    named_not_run = [name for name in args.check or () if name not in ran]
    if named_not_run:  # asked for by name: passing it over is not a result
        print(f"not run, though named with --check: {', '.join(named_not_run)} (another build is loaded)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
