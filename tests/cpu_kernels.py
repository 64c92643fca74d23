"""The CPU kernel builds tests run one by one: AVX-512, AVX2 (with F16C and FMA) and generic. A build the processor cannot run
is skipped with the reason (the library would otherwise quietly run a lower one)."""

import ctypes
import os
import pathlib
import platform
import subprocess

import pytest

from kvcache_op.capi import c_api

#: CPU flags (/proc/cpuinfo names) each build needs; the library picks the best one the processor has, and
#: $KVCACHE_OP_CPU_KERNEL caps it.
NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "f16c", "fma"}, "avx2": {"avx2", "f16c", "fma"}, "generic": set()}


#: The -m flags each build compiles with (CMakeLists.txt's kv_cpu_<build> targets).
ISA_FLAGS = {"generic": [], "avx2": ["-mavx2", "-mf16c", "-mfma"],
             "avx512": ["-mavx2", "-mf16c", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl"]}


def build_flags(kernel: str) -> list:
    """The compiler flags of ``kernel``'s build, as CMakeLists.txt gives them: KV_CPU_ISA, its -m flags and, for
    AVX-512 under GCC, off the warnings its headers raise at every use (GCC bug 105593)."""
    from native_build import compiler

    flags = [f"-DKV_CPU_ISA={kernel}"] + ISA_FLAGS[kernel]
    if kernel == "avx512" and "clang" not in subprocess.run([compiler(), "--version"], capture_output=True,
                                                            text=True).stdout:
        flags += ["-Wno-maybe-uninitialized", "-Wno-uninitialized"]
    return flags


def cpuinfo_fields() -> dict:
    """The first processor's /proc/cpuinfo fields (vendor_id, cpu family, model, flags, ...); empty where there is
    none."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set:
    """This processor's flags from /proc/cpuinfo (empty where there is none)."""
    return set(cpuinfo_fields().get("flags", "").split())


def amd_processor() -> bool:
    """Whether the kernels' measured choices follow an AMD processor's: as $KVCACHE_OP_CPU_VENDOR names ("amd" or
    "intel"), else whether this is an x86-64 AMD processor."""
    named = os.environ.get("KVCACHE_OP_CPU_VENDOR")
    if named in ("amd", "intel"):
        return named == "amd"
    return cpuinfo_fields().get("vendor_id") == "AuthenticAMD"


#: The kinds $KVCACHE_OP_CPU_VENDOR names, and None (this processor's own), for tests that hold each kind's
#: measured choices.
CPU_VENDORS = (None, "amd", "intel")


def use_cpu_vendor(monkeypatch, vendor) -> None:
    """Makes the library's measured choices follow ``vendor``'s ("amd", "intel"; None: this processor's)."""
    if vendor is None:
        monkeypatch.delenv("KVCACHE_OP_CPU_VENDOR", raising=False)
    else:
        monkeypatch.setenv("KVCACHE_OP_CPU_VENDOR", vendor)


def _skip_reason(name: str) -> str | None:
    """Why this processor cannot run build ``name``, or None."""
    if name == "generic":
        return None
    if platform.machine() not in ("x86_64", "AMD64"):
        return "not an x86-64 processor"
    missing = sorted(NEEDS[name] - cpu_flags())
    return f"this processor lacks {', '.join(missing)}" if missing else None


def _param(name: str):
    reason = _skip_reason(name)
    return pytest.param(name, id=name, marks=[pytest.mark.skip(reason=f"{name} build: {reason}")] if reason else [])


#: pytest params of every build, best first.
CPU_KERNELS = [_param(name) for name in NEEDS]


def use_cpu_kernel(monkeypatch, kernel: str) -> None:
    """Makes the library run ``kernel`` (one of :data:`NEEDS`) in this test, and checks that it does."""
    monkeypatch.setenv("KVCACHE_OP_CPU_KERNEL", kernel)
    assert c_api.cpu_kernel() == kernel, f"asked for the {kernel} build, the library runs {c_api.cpu_kernel()}"


REPORT_PREFIX = "kvcache_op KeyValueCache cpu: "


def call_reports(stderr: str) -> list:
    """The plans KeyValueCache calls on the CPU printed under $KVCACHE_OP_CPU_VERBOSE=1, in order: one dict a call,
    each field as printed (numbers as ints)."""
    reports = []
    for line in stderr.splitlines():
        if line.startswith(REPORT_PREFIX):
            fields = dict(item.split("=", 1) for item in line[len(REPORT_PREFIX):].split())
            reports.append({k: int(v) if v.lstrip("-").isdigit() else v for k, v in fields.items()})
    return reports


def expected_prefetch_heads(quant_bit: int, heads: int, head_dim: int) -> int:
    """The heads of a token KeyValueCache's token-order gathers ask for ahead (the plan's prefetch_heads), from the
    token prefetch query: every head unquantized; quantized, the heads whose codes lie wholly in the bytes asked for
    (at least one; every head where the query says whole rows, 0)."""
    if quant_bit == 0:
        return heads
    head_bytes = max(1, head_dim * quant_bit // 8)
    asked = c_api.cpu_token_prefetch_bytes(heads * head_bytes)
    return heads if asked == 0 else min(max(asked // head_bytes, 1), heads)


@pytest.fixture(scope="module")
def mxcsr(tmp_path_factory):
    """tests/mxcsr.cc built once: kv_test_set_flush_modes(bits: 1 denormals-are-zero, 2 flush-to-zero) and
    kv_test_set_rounding(mode: 0 nearest, 1 down, 2 up, 3 toward zero), each -> the previous MXCSR. x86-64 only."""
    from native_build import build_library

    source = pathlib.Path(__file__).with_name("mxcsr.cc")
    lib = ctypes.CDLL(str(build_library("mxcsr", [source], [], ["-O1", "-fPIC", "-shared"],
                                        tmp_path_factory.mktemp("mxcsr"))))
    for name in ("kv_test_set_flush_modes", "kv_test_set_rounding"):
        getattr(lib, name).argtypes = [ctypes.c_uint]
        getattr(lib, name).restype = ctypes.c_uint
    return lib


X86_64 = platform.machine().lower() in ("x86_64", "amd64")
#: The tests that set MXCSR skip elsewhere.
NEEDS_MXCSR = pytest.mark.skipif(not X86_64, reason="MXCSR is x86-64's")


def give_back_mxcsr(mxcsr, before: int) -> None:
    """Sets the thread's rounding mode, denormals-are-zero and flush-to-zero back as ``before`` (an MXCSR value)
    holds them."""
    mxcsr.kv_test_set_rounding((before >> 13) & 3)
    mxcsr.kv_test_set_flush_modes(((before >> 6) & 1) | ((before >> 14) & 2))
