"""The streamed outputs' line writer (cpu/kv_line_streams.h), byte for byte against numpy's assignment of the same
rows: rows of any size at any offset from a cache line, in any order, with gaps between them left untouched; more
lines left part written at once than its table holds (lines pushed out are written part by part with ordinary
stores); two threads, each with its own writer, writing the two halves of shared lines at the same time (neither
may stream a line it did not write whole); and, in the AVX-512 build, rows of whole vectors cut into lines in
registers (ShiftedRow) and rows read as runs side by side (cpu/kv_row_streams.h). Built once per instruction set with
the kernel's flags; a build the processor cannot run is skipped with the reason."""

import ctypes
import pathlib

import numpy as np
import pytest
from cpu_kernels import CPU_KERNELS, build_flags
from native_build import build_library
from written_rows import row_buffers

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests/line_streams.cc"
HEADERS = [ROOT / "cpu/kv_line_streams.h", ROOT / "cpu/kv_row_streams.h", ROOT / "cpu/kv_cpu_rows.h",
           ROOT / "cpu/kv_types.h"]
STRICT = ["-std=c++17", "-fPIC", "-shared", "-pthread", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'cpu'}"]
TABLE_SLOTS = 1024  # LineStreams::kSlots: the lines one writer holds at once


@pytest.fixture(scope="module")
def libraries(request, tmp_path_factory):
    """Each build's library, by name, built on first use."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("line_streams") if cache else tmp_path_factory.mktemp("line_streams")
    built = {}

    def library(kernel):
        if kernel not in built:
            flags = STRICT + build_flags(kernel)
            lib = ctypes.CDLL(str(build_library(f"line_streams-{kernel}", [SOURCE], HEADERS, flags, folder)))
            pointers = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
            for name in ("line_streams_write", "line_streams_write_two_threads", "line_streams_write_nested"):
                getattr(lib, name).argtypes = pointers
                getattr(lib, name).restype = ctypes.c_int
            lib.line_streams_shifted.restype = ctypes.c_int
            lib.line_streams_side_by_side.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int]
            lib.line_streams_side_by_side.restype = ctypes.c_int
            built[kernel] = lib
        return built[kernel]

    return library


def written(lib, rows, order, size=None, shifted=False, threads=1, seed=0, nested=False):
    """(what the writer left, what numpy's assignment gives) for ``rows`` [(offset, size)] written in ``order``
    into a buffer of random bytes whose start is a cache line; src holds other random bytes. threads=2: two
    threads at once; nested: two writers in one thread."""
    size = size or max(o + n for o, n in rows) + 256
    out, src, want = row_buffers(size, rows, seed)
    offsets = np.array([rows[i][0] for i in order], np.int64)
    sizes = np.array([rows[i][1] for i in order], np.int64)
    fn = (lib.line_streams_write_nested if nested else
          lib.line_streams_write if threads == 1 else lib.line_streams_write_two_threads)
    assert fn(out.ctypes.data, src.ctypes.data, offsets.ctypes.data, sizes.ctypes.data, len(order), int(shifted)) == 0
    return out, want


def tiling(rng, total, smallest, largest, start=0):
    """Rows that tile [start, start + total) with sizes drawn from [smallest, largest]."""
    rows, offset = [], start
    while offset < start + total:
        n = min(int(rng.integers(smallest, largest + 1)), start + total - offset)
        rows.append((offset, n))
        offset += n
    return rows


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("seed", range(6))
def test_rows_of_any_size_and_offset_in_any_order_give_numpys_bytes(libraries, kernel, seed):
    """Rows of 1-300 bytes tiling a region that starts anywhere in a line, written in order, in reverse and
    shuffled; and with every third row left out, whose bytes must keep the buffer's."""
    lib = libraries(kernel)
    rng = np.random.default_rng(seed)
    rows = tiling(rng, 20000, 1, 300, start=int(rng.integers(0, 64)))
    for order in (range(len(rows)), range(len(rows) - 1, -1, -1), rng.permutation(len(rows))):
        out, want = written(lib, rows, list(order), seed=seed)
        np.testing.assert_array_equal(out, want)
    gapped = rows[::3] + rows[1::3]
    out, want = written(lib, gapped, list(rng.permutation(len(gapped))), seed=seed)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_more_part_lines_than_the_table_holds_are_written_part_by_part(libraries, kernel):
    """One 16-byte quarter of each of 4x as many lines as the table holds, then their other quarters in turn
    (every line left part written until its last quarter: lines are pushed out of the table and written part by
    part); then head rows of 256 bytes 16 bytes past a line in head order over 2,048 tokens (a token's rows far
    apart, as layout 3's gathers write them: about 4,000 lines held at once)."""
    lib = libraries(kernel)
    lines = 4 * TABLE_SLOTS
    quarters = [(64 * line + 16 * q + 16, 16) for q in range(4) for line in range(lines - 1)]
    out, want = written(lib, quarters, list(range(len(quarters))))
    np.testing.assert_array_equal(out, want)
    tokens, heads, row = 2 * TABLE_SLOTS, 8, 256
    head_rows = [(16 + (t * heads + h) * row, row) for h in range(heads) for t in range(tokens)]
    out, want = written(lib, head_rows, list(range(len(head_rows))))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("row", [16, 48, 80, 256])
def test_two_threads_sharing_lines_each_write_only_their_own_bytes(libraries, kernel, row):
    """Alternate rows by two threads at once, each with its own writer: lines at rows' edges (all of them for
    rows of 16, 48 and 256 bytes 16 bytes past a line, three in four for 80) hold bytes of both threads, so
    neither may stream them (a whole-line store would overwrite the other's bytes); repeated, since a lost write
    shows only when the two land close together."""
    lib = libraries(kernel)
    rows = [(16 + i * row, row) for i in range(40000 // row * 16)]
    for seed in range(8):
        out, want = written(lib, rows, list(range(len(rows))), threads=2, seed=seed)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_two_writers_alive_in_one_thread_each_keep_their_lines(libraries, kernel):
    """Alternate rows through two writers alive at once in one thread (the second takes a table of its own):
    their shared lines are written part by part, each writer's bytes only."""
    lib = libraries(kernel)
    rows = [(16 + i * 48, 48) for i in range(3000)]
    out, want = written(lib, rows, list(range(len(rows))), nested=True)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("offset", range(0, 64, 2))
def test_rows_cut_into_lines_in_registers_give_numpys_bytes(libraries, kernel, offset):
    """ShiftedRow (the AVX-512 build's dequantized rows): rows of 1-4 vectors at an even offset from a line (offsets
    of whole 4-byte dwords cut by LineCut's dword permute, the others by its word one; offset 0 not cut), in order,
    shuffled, by two threads, and in head order over more tokens than the table holds."""
    lib = libraries(kernel)
    if not lib.line_streams_shifted():
        pytest.skip(f"the {kernel} build has no ShiftedRow (AVX-512 only)")
    rng = np.random.default_rng(offset)
    rows, at = [], offset
    for n in rng.integers(1, 5, 3000):
        rows.append((at, 64 * int(n)))
        at += 64 * int(n)
    for order, threads in ((range(len(rows)), 1), (rng.permutation(len(rows)), 1), (range(len(rows)), 2)):
        out, want = written(lib, rows, list(order), shifted=True, threads=threads)
        np.testing.assert_array_equal(out, want)
    tokens, heads = 2 * TABLE_SLOTS, 8
    head_rows = [(offset + (t * heads + h) * 256, 256) for h in range(heads) for t in range(tokens)]
    out, want = written(lib, head_rows, list(range(len(head_rows))), shifted=True)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("offset", [0, 2, 6, 16, 20, 48, 62])  # lines cut by the word permute and by the dword one
def test_rows_read_as_runs_side_by_side_give_numpys_bytes(libraries, kernel, offset):
    """WriteRowsSideBySide (the AVX-512 build's token streams): rows of 1, 2 and 5 vectors at an even offset from a
    line, as 1 to 17 runs side by side (more runs than rows, runs of unequal length) in chunks of 64 to 320 bytes
    (short last chunks), each row led by the row before where it is written too; with rows left out (the edge lines
    next to a gap held until flushed, no byte of the gap written), a list of one row, an empty one, and two threads
    each writing half the rows at once (the line where the halves meet shared, neither may stream it)."""
    lib = libraries(kernel)
    if not lib.line_streams_shifted():
        pytest.skip(f"the {kernel} build has no runs side by side (AVX-512 only)")
    rng = np.random.default_rng(offset)
    for vectors in (1, 2, 5):
        size = 64 * vectors
        every = [(offset + i * size, size) for i in range(97)]
        gapped = [row for row, keep in zip(every, rng.random(len(every)) < 0.7) if keep]
        for rows, streams, chunk, threads in (
                (every, 1, 256, 1), (every, 3, 64, 1), (every, 8, 256, 1), (every, 16, 320, 1), (every, 8, 256, 2),
                (gapped, 8, 256, 1), (gapped, 17, 128, 1), (gapped, 5, 192, 2), (every[:5], 16, 256, 1),
                (every[:1], 8, 256, 1), ([], 8, 256, 1)):
            out, src, want = row_buffers(offset + len(every) * size + 256, rows, int(rng.integers(1 << 30)))
            offsets = np.array([o for o, _ in rows], np.int64)
            assert lib.line_streams_side_by_side(out.ctypes.data, src.ctypes.data, offsets.ctypes.data, len(rows), size,
                                                 streams, chunk, threads) == 0
            np.testing.assert_array_equal(out, want, err_msg=f"{len(rows)} rows of {size} B, {streams} runs, "
                                                             f"chunk {chunk}, {threads} threads")
    out, src, _ = row_buffers(4096, [], 0)
    odd = np.array([offset + 1], np.int64)
    assert lib.line_streams_side_by_side(out.ctypes.data, src.ctypes.data, odd.ctypes.data, 1, 128, 8, 256, 1) == -1
