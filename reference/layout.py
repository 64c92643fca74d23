"""Cache layouts: the four axis orders of the logical (L, 2, H, MaxT, Dh) cache."""

import numpy as np

# Axis names in the order each cache_layout stores them.
LAYOUT_AXES = {
    0: ("MaxT", "L", "KV", "H", "Dh"),
    1: ("L", "MaxT", "KV", "H", "Dh"),
    2: ("L", "KV", "MaxT", "H", "Dh"),
    3: ("L", "KV", "H", "MaxT", "Dh"),
}
_CANONICAL = ("L", "KV", "H", "MaxT", "Dh")


def cache_shape(cache_layout: int, num_layer: int, max_t: int, num_heads: int, last_dim: int) -> tuple:
    """Shape of a cache (``last_dim = Dh``) or scale (``last_dim = Dh / quant_group``) tensor."""
    sizes = {"MaxT": max_t, "L": num_layer, "KV": 2, "H": num_heads, "Dh": last_dim}
    return tuple(sizes[a] for a in LAYOUT_AXES[cache_layout])


def dims_of(cache_layout: int, shape: tuple) -> dict:
    """Name -> size of each axis of a tensor stored in ``cache_layout``."""
    return dict(zip(LAYOUT_AXES[cache_layout], shape))


def canonical_view(tensor: np.ndarray, cache_layout: int) -> np.ndarray:
    """A view of ``tensor`` with axes (L, 2, H, MaxT, last); writes go to ``tensor``."""
    axes = LAYOUT_AXES[cache_layout]
    return tensor.transpose([axes.index(a) for a in _CANONICAL])
