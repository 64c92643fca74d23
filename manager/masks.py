"""The block-diagonal causal mask (with an optional sliding-window band) matching a step's keys."""

import numpy as np


def block_diagonal_causal_mask(seqstarts, kvstarts, query_positions, key_positions, sliding_window=None):
    """Boolean ``(seqstarts[B], kvstarts[B])``: query i may attend key j iff both belong to the same
    sequence, ``key_pos <= query_pos``, and with a window W, ``key_pos > query_pos - W``."""
    seqstarts, kvstarts = np.asarray(seqstarts), np.asarray(kvstarts)
    q_seq = np.repeat(np.arange(len(seqstarts) - 1), np.diff(seqstarts))
    k_seq = np.repeat(np.arange(len(kvstarts) - 1), np.diff(kvstarts))
    q = np.asarray(query_positions)[:, None]
    k = np.asarray(key_positions)[None, :]
    mask = (q_seq[:, None] == k_seq[None, :]) & (k <= q)
    if sliding_window is not None:
        mask &= k > q - sliding_window
    return mask
