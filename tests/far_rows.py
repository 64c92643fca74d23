"""A call's cache rows moved past 2^31 elements, for the host runners' tests of 64-bit addressing.

The moved cache is allocated lazily (np.zeros): only the rows a call touches take memory, so a 2.2 GB cache costs a
few megabytes. Layout 0 ([MaxT, L, 2, H, Dh]) only: a slot's rows are then one contiguous block, moved as a whole.
"""

import numpy as np
from ort_helpers import copies


def slots_past_2_to_the_31(cache: np.ndarray) -> int:
    """How many slots to move a layout-0 cache by so that every row of it starts past 2^31 elements."""
    moved = 2**31 // cache[0].size + 1000
    assert moved * cache[0].size > 2**31
    return moved


def moved_cache(inputs: dict, moved: int) -> tuple:
    """The case's cache and scale with their slots s at s + moved (layout 0), zeros below."""
    cache = np.zeros((moved + inputs["cache"].shape[0], *inputs["cache"].shape[1:]), inputs["cache"].dtype)
    scale = np.zeros((moved + inputs["scale"].shape[0], *inputs["scale"].shape[1:]), inputs["scale"].dtype)
    cache[moved:], scale[moved:] = inputs["cache"], inputs["scale"]
    return cache, scale


def moved_call(inputs: dict, moved: int) -> tuple:
    """(inputs of the same call on the moved cache: copies of the other inputs, the page table's used entries
    moved too; the moved cache; the moved scale)."""
    cache, scale = moved_cache(inputs, moved)
    table = inputs["cachestarts"].copy()
    table[table >= 0] += moved
    far = dict(copies({k: v for k, v in inputs.items() if k not in ("cache", "scale")}), cache=cache, scale=scale,
               cachestarts=table)
    return far, cache, scale
