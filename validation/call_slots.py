"""The cache slot of every token one call stores and gathers, as two flat vectors (numpy, no loop over
sequences): what a vectorized implementation of the op indexes with."""

import numpy as np


def call_slots(seqstarts, kvstarts, cachestarts, start_pos, *, cache_mode: int, page_size: int) -> tuple:
    """``(store_slots, load_slots)`` of a valid call, int64: ``store_slots[seqstarts[b] + i]`` is the slot
    of position ``start_pos[b] + i`` of sequence ``b`` (the row ``current[seqstarts[b] + i]`` goes to),
    ``load_slots[kvstarts[b] + t]`` the slot of position ``t`` (the row ``key[kvstarts[b] + t]`` comes
    from). Slots follow the spec: ``cachestarts[b] + p`` (cache_mode 0), ``cachestarts[b, p // page_size]
    + p % page_size`` (cache_mode 1). The call is not validated: give it one the op accepts."""
    seq = np.asarray(seqstarts, np.int64)
    kv = np.asarray(kvstarts, np.int64)
    table = np.asarray(cachestarts, np.int64)
    pos = np.asarray(start_pos, np.int64)
    store_seq, store_pos = _positions(seq, pos)
    load_seq, load_pos = _positions(kv, np.zeros_like(pos))
    return _slots(table, store_seq, store_pos, cache_mode, page_size), _slots(table, load_seq, load_pos,
                                                                              cache_mode, page_size)


def _positions(starts: np.ndarray, first: np.ndarray) -> tuple:
    """Per row of a packed tensor: its sequence and its position ``first[b] + (row - starts[b])``."""
    lengths = np.diff(starts)
    seq = np.repeat(np.arange(lengths.size), lengths)
    rows = np.arange(starts[-1], dtype=np.int64)
    return seq, first[seq] + rows - starts[seq]


def _slots(table: np.ndarray, seq: np.ndarray, pos: np.ndarray, cache_mode: int, page_size: int) -> np.ndarray:
    if cache_mode == 0:
        return table[seq] + pos
    return table[seq, pos // page_size] + pos % page_size
