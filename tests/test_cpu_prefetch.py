"""The cache readers' software prefetches survive the compiler. GCC counts ``__builtin_prefetch`` as free of side
effects: a reader function whose only work is prefetching was found pure by its interprocedural analysis and every
call of it deleted, leaving the library without a single prefetch instruction (and the decode step reading the
cache at half the speed). The library must hold them, in every x86-64 kernel build."""

import platform
import shutil
import subprocess

import pytest

from kvcache_op.ort_ops import library_path


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 prefetch instructions")
def test_the_library_keeps_its_prefetch_instructions():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump (binutils) is needed to read the library's instructions and is not installed")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", library_path()], capture_output=True, text=True,
                             check=True).stdout
    # Per kernel build (namespace generic, avx2, avx512 in the symbols), the prefetches inside its functions.
    counts, build = {"generic": 0, "avx2": 0, "avx512": 0}, None
    for line in listing.splitlines():
        if line.endswith(">:"):  # a function's first line: <mangled name>:
            build = next((b for b in ("avx512", "avx2", "generic") if f"kvcache{len(b)}{b}" in line), None)
        elif build and "\tprefetcht0" in line:
            counts[build] += 1
    assert all(n > 0 for n in counts.values()), f"prefetch instructions per CPU kernel build: {counts}"
