"""Caches are pre-filled with random sentinels; only the stored slots of this layer may change."""

import numpy as np
import pytest
from hypothesis import given

from kvcache_op.reference import canonical_view, key_value_cache
from strategies import COMBINATIONS, calls_for


def stored_slots(inputs, attrs):
    """Slots this call stores, computed from the inputs with the spec's slot formula."""
    slots = set()
    seq, pos, table = inputs["seqstarts"], inputs["start_pos"], inputs["cachestarts"]
    for b in range(len(pos)):
        for p in range(int(pos[b]), int(pos[b]) + int(seq[b + 1] - seq[b])):
            if attrs["cache_mode"] == 0:
                slots.add(int(table[b]) + p)
            else:
                slots.add(int(table[b][p // attrs["page_size"]]) + p % attrs["page_size"])
    return sorted(slots)


@pytest.mark.parametrize("combo", COMBINATIONS[::3], ids=lambda c: f"q{c[0]}-mode{c[1]}-layout{c[2]}")
def test_only_stored_slots_of_the_layer_change(combo):
    @given(calls_for(combo))
    def check(case):
        before = {k: (None if v is None else v.copy()) for k, v in case.inputs.items()}
        key_value_cache(**case.inputs, **case.attributes)
        layout, layer = case.attributes["cache_layout"], case.attributes["layer_idx"]
        for name in ("cache", "scale") if case.attributes["quant_bit"] else ("cache",):  # else no scale to write
            old = canonical_view(before[name], layout).copy()  # (L, 2, H, MaxT, last)
            new = canonical_view(case.inputs[name], layout).copy()
            written = np.zeros(old.shape[:4], bool)
            written[layer, :, :, stored_slots(before, case.attributes)] = True
            assert old[~written].tobytes() == new[~written].tobytes(), f"{name}: a cell outside the stored slots changed"

    check()
