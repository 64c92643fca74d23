"""The block-diagonal causal mask (with an optional sliding-window band) matching a step's keys."""

import numpy as np

from .identity import check_int


def block_diagonal_causal_mask(seqstarts, kvstarts, query_positions, key_positions, sliding_window=None):
    """Boolean ``(seqstarts[B], kvstarts[B])``: query i may attend key j iff both belong to the same
    sequence, ``key_pos <= query_pos``, and with a window W, ``key_pos > query_pos - W``. ``sliding_window`` None
    or 0 is no window (0 is the ops' "off", never a window that hides every key); below 0 is a ``ValueError``, a
    window that is not an integer (``True``, ``1.5``) a ``TypeError``."""
    if sliding_window is not None:
        sliding_window = check_int("sliding_window", sliding_window)
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be None, 0 (off) or a window >= 1, got {sliding_window}")
    seqstarts, kvstarts = np.asarray(seqstarts), np.asarray(kvstarts)
    q_seq = np.repeat(np.arange(len(seqstarts) - 1), np.diff(seqstarts))
    k_seq = np.repeat(np.arange(len(kvstarts) - 1), np.diff(kvstarts))
    q = np.asarray(query_positions)[:, None]
    k = np.asarray(key_positions)[None, :]
    mask = (q_seq[:, None] == k_seq[None, :]) & (k <= q)
    if sliding_window:
        mask &= k > q - sliding_window
    return mask
