"""The buffers of the line writers' tests (test_line_streams.py, test_interleaved_streams.py): what a writer
starts from and what numpy's assignment of the same rows leaves."""

import numpy as np


def row_buffers(size, rows, seed):
    """(out, src, want): ``size`` random bytes starting on a cache line, other random bytes to copy rows from,
    and what out holds once each row (offset, n) of ``rows`` has src's bytes at its offset."""
    rng = np.random.default_rng(seed)
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    out = raw[start:start + size]
    out[:] = rng.integers(0, 256, size, dtype=np.uint8)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    want = out.copy()
    for offset, n in rows:
        want[offset:offset + n] = src[offset:offset + n]
    return out, src, want
