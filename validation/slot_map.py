"""Where a KeyValueCache call's elements live in the cache: the slot each output element is loaded from, and
the cache/scale elements the call stores. The validator uses it to name the code and scale behind a
differing output and to apply the tolerance table only where the spec allows it (stored slots)."""

import numpy as np

from ..reference.layout import canonical_view
from ..reference.validate import Attributes, effective_scale, validate_call


class SlotMap:
    """The plan of a valid call (``inputs`` by formal name, ``attributes``): flat cache/scale indices of every
    output element, and masks of the stored elements. ``KeyValueCacheError`` for an invalid call."""

    def __init__(self, inputs: dict, attributes: dict):
        fields = Attributes.__dataclass_fields__
        self.attrs = Attributes(**{k: int(v) for k, v in attributes.items() if k in fields})
        scale = effective_scale(inputs.get("scale"), self.attrs.quant_bit)
        names = ("current_key", "current_value", "seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen",
                 "max_kvlen", "cache")
        self.plan = validate_call(*(inputs[n] for n in names), scale, self.attrs)
        self.heads = np.asarray(inputs["current_key"]).shape[1]
        self.cache_shape = np.shape(inputs["cache"])
        self.scale_shape = None if scale is None else np.shape(scale)

    def _indices(self, shape) -> np.ndarray:
        """(2, H, MaxT, last) flat indices of this layer's elements of a tensor of ``shape``."""
        flat = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
        return canonical_view(flat, self.attrs.cache_layout)[self.attrs.layer_idx]

    def source(self, kv: int, scale: bool = False) -> np.ndarray:
        """Flat cache (or scale) index of the element each ``key`` (kv 0) or ``value`` (kv 1) output element is
        loaded from, shape ``(kvstarts[B], H * num_repeat, Dh)``."""
        view = self._indices(self.scale_shape if scale else self.cache_shape)[kv]
        slots = np.concatenate([np.zeros(0, np.int64)] + [np.asarray(s, np.int64) for s in self.plan.load_slots])
        heads = np.arange(self.heads * self.attrs.num_repeat) // self.attrs.num_repeat
        dims = np.arange(self.cache_shape[-1])
        last = dims // self.attrs.quant_group if scale else dims
        return view[heads[None, :, None], slots[:, None, None], last[None, None, :]]

    def stored(self, scale: bool = False) -> np.ndarray:
        """Boolean mask over the cache (or scale) of the elements this call stores."""
        shape = self.scale_shape if scale else self.cache_shape
        mask = np.zeros(int(np.prod(shape)), bool)
        view = self._indices(shape)
        for slots in self.plan.store_slots:
            mask[view[:, :, np.asarray(slots, np.int64), :].reshape(-1)] = True
        return mask.reshape(shape)

    def describe(self, kv: int, row: int, column: int) -> str:
        """``slot S (sequence b, position t), head h`` for output element (row, column) of key/value."""
        begins = np.asarray(self.plan.kv_begin, np.int64)
        b = int(np.searchsorted(begins, row, side="right") - 1)
        while self.plan.kv_len[b] == 0 or row >= begins[b] + self.plan.kv_len[b]:
            b -= 1  # empty sequences share their begin with the next one
        t = row - int(begins[b])
        return (f"cache slot {int(self.plan.load_slots[b][t])} (sequence {b}, position {t}), "
                f"head {column // self.attrs.num_repeat}")
