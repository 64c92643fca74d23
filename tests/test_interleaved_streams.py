"""The stores' writer of interleaved row streams (cpu/kv_interleaved_streams.h: layout 3's scale rows), byte for
byte against numpy's assignment of the same rows: streams of 32-byte rows (half lines) laid out as layout 3 lays
out a token's scale rows, over pages of a shuffled page table, written token by token or in any order, with rows
left out whose bytes must stay; 64-byte rows on a line and off it; the halves of shared lines written by two
threads at once, each with its own writer (neither may stream a line it did not write whole). Built with the
AVX-512 kernel's flags, the only build that streams them."""

import ctypes
import pathlib

import numpy as np
import pytest
from cpu_kernels import CPU_KERNELS, build_flags
from native_build import build_library
from written_rows import row_buffers

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests/interleaved_streams.cc"
HEADERS = [ROOT / "cpu/kv_interleaved_streams.h", ROOT / "cpu/kv_cpu_rows.h", ROOT / "cpu/kv_types.h"]
STRICT = ["-std=c++17", "-fPIC", "-shared", "-pthread", "-O2", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'cpu'}"]
AVX512 = [p for p in CPU_KERNELS if p.values[0] == "avx512"]


@pytest.fixture(scope="module")
def library(request, tmp_path_factory):
    """The AVX-512 build's test library."""
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("interleaved_streams") if cache else tmp_path_factory.mktemp("interleaved_streams")
    lib = ctypes.CDLL(str(build_library("interleaved_streams-avx512", [SOURCE], HEADERS,
                                        STRICT + build_flags("avx512"), folder)))
    for name in ("interleaved_streams_write", "interleaved_streams_write_two_threads"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2
        getattr(lib, name).restype = ctypes.c_int
    return lib


def written(lib, rows, streams, order, size, threads=1, seed=0):
    """(what the writer left, what numpy's assignment gives) for ``rows`` [(stream, offset, size)] written in
    ``order`` into a buffer of random bytes whose start is a cache line; src holds other random bytes."""
    out, src, want = row_buffers(size, [(offset, n) for _, offset, n in rows], seed)
    columns = [np.array([rows[i][k] for i in order], np.int64) for k in range(3)]
    fn = lib.interleaved_streams_write if threads == 1 else lib.interleaved_streams_write_two_threads
    assert fn(out.ctypes.data, src.ctypes.data, *(c.ctypes.data for c in columns), len(order), streams) == 0
    return out, want


def scale_rows(rng, streams, tokens, page_size, row, start, skip=0.0):
    """Layout 3's scale rows of ``tokens`` tokens, token by token: token t's row of stream s at
    start + (s * max_t + slot(t)) * row, slots in pages of ``page_size`` from a shuffled page table; a ``skip``
    share of tokens left out. Returns (rows, buffer size)."""
    pages = -(-tokens // page_size)
    max_t = pages * page_size
    table = rng.permutation(pages)
    kept = [t for t in range(tokens) if rng.random() >= skip]
    rows = [(s, start + (s * max_t + table[t // page_size] * page_size + t % page_size) * row, row)
            for t in kept for s in range(streams)]
    return rows, start + streams * max_t * row + 64


@pytest.mark.parametrize("kernel", AVX512)
@pytest.mark.parametrize("page_size", [64, 5, 7, 1])
@pytest.mark.parametrize("start", [0, 32, 16])
def test_half_line_rows_of_interleaved_streams_give_numpys_bytes(library, kernel, page_size, start):
    """16 streams of 32-byte rows token by token, as layout 3's scale rows (on half lines where ``start`` is 0 or
    32: held and streamed whole; 16: ordinary stores), over 300 tokens, then with a third of the tokens left out,
    then in a random order."""
    rng = np.random.default_rng(page_size * 100 + start)
    rows, size = scale_rows(rng, 16, 300, page_size, 32, start)
    out, want = written(library, rows, 16, list(range(len(rows))), size)
    np.testing.assert_array_equal(out, want)
    gapped, gapped_size = scale_rows(rng, 16, 300, page_size, 32, start, skip=1 / 3)
    out, want = written(library, gapped, 16, list(range(len(gapped))), gapped_size, seed=1)
    np.testing.assert_array_equal(out, want)
    out, want = written(library, rows, 16, list(rng.permutation(len(rows))), size, seed=2)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", AVX512)
@pytest.mark.parametrize("start", [0, 16, 32])
def test_whole_line_rows_give_numpys_bytes(library, kernel, start):
    """Rows of 64 bytes (16 float32 scales): streamed at once on a line, stored as they are off one."""
    rng = np.random.default_rng(start)
    rows, size = scale_rows(rng, 4, 200, 16, 64, start)
    out, want = written(library, rows, 4, list(range(len(rows))), size)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("kernel", AVX512)
@pytest.mark.parametrize("page_size", [64, 6])
def test_two_threads_sharing_lines_each_write_only_their_own_bytes(library, kernel, page_size):
    """Tokens by two threads in turn, each with its own writer: with pages of an even number of slots every line
    holds one half from each thread, so each is written with masked stores of the writer's own half, never
    streamed; repeated, since a lost write shows only when the two land close together."""
    rng = np.random.default_rng(page_size)
    for seed in range(6):
        rows, size = scale_rows(rng, 8, 2000, page_size, 32, 0)
        # row 8 t + s is token t's of stream s; the threads take the even and the odd places of the order, so
        # one writes the even tokens and the other the odd ones, each token by token
        order = [8 * t + s for t0 in range(0, 2000, 2) for s in range(8) for t in (t0, t0 + 1)]
        out, want = written(library, rows, 8, order, size, threads=2, seed=seed)
        np.testing.assert_array_equal(out, want)
