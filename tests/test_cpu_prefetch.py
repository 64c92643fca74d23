"""The cache readers' software prefetches survive the compiler. GCC counts ``__builtin_prefetch`` as free of side
effects: a reader function whose only work is prefetching was found pure by its interprocedural analysis and every
call of it deleted, leaving the library without a single prefetch instruction (and the decode step reading the
cache at half the speed). The library must hold them, those into the first-level cache and, for layout 3's
unquantized head rows (``c_api.cpu_head_prefetch``), those into the second."""

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
    # The installed library is stripped, so the prefetches are counted over the whole library: the KeyValueCache
    # and MultiHeadCacheAttention readers of three kernel builds hold hundreds; with the calls deleted it held none.
    lines = listing.splitlines()
    counts = {name: sum(1 for line in lines if f"\t{name}" in line) for name in ("prefetcht0", "prefetcht1")}
    assert counts["prefetcht0"] >= 3, f"{counts['prefetcht0']} prefetch instructions in {library_path()}"
    # The second-level ones, a few in each build's layout-3 value readers (none before those readers asked for them).
    assert counts["prefetcht1"] >= 3, f"{counts['prefetcht1']} second-level prefetch instructions in {library_path()}"
