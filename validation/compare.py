"""Compares a backend's outcome of a call with the expected one and says precisely what differs.

:func:`compare` returns one line per problem (empty: the backend passes): for a differing tensor, how many
elements differ, the first one's index and both values (with their bits), and for a quantized cache the
code and scale behind it. KeyValueCache is compared bit for bit (``tolerance="exact"``) or with the spec's
tolerance table (``"spec"``, kvcache_op.validation.tolerance); KeyCacheRotaryShift bit for bit in both modes
(its spec documents no other arithmetic); MultiHeadAttention within the expected outcome's per-element bound;
MultiHeadCacheAttention's cache as KeyValueCache's and its output as MultiHeadAttention's: under the tolerance
table a quantized cache may hold other codes and scales than the reference's, so where the backend's cache passes
the table *and* every code it stored is its value over the backend's own scale rounded to nearest (a faithful
quantization, in another arithmetic), its output is held to the bound over the keys and values in *its* cache (the
reference's attention over them), not over the reference's; where the scales are float16, the attention over those
keys dequantized in float16 (the table's ppl torch row) passes too. Under the table, for both ops, a code the table's
+-1 accepts but its own scale does not explain (rounded up, truncated, flushed to zero, past qmax) fails. An invalid
call must fail and leave the in-place inputs byte-for-byte as they were.
"""

import numpy as np

from ..reference.dtypes import BFLOAT16, INT4, QMAX
from ..spec import mha_schema
from ..spec.schema import ATTRIBUTE_DEFAULTS as CACHE_ATTRIBUTES
from ..spec.schema import INPUTS as CACHE_INPUTS
from . import tolerance as spec_tolerance
from .outcome import Outcome, copies
from .tolerance import bits_differ, special_values

TOLERANCES = ("exact", "spec")


#: Ops that store into a cache (compared as KeyValueCache's), and the output each attention op holds to a bound.
CACHE_OPS = ("KeyValueCache", "MultiHeadCacheAttention")
ATTENTION_OUTPUTS = {"MultiHeadAttention": "attention_output", "MultiHeadCacheAttention": "output"}


def cache_call(op: str, inputs: dict, attributes: dict) -> tuple:
    """(inputs, attributes) of the KeyValueCache call an op's cache writes are (itself, or the first half of
    MultiHeadCacheAttention)."""
    if op == "KeyValueCache":
        return inputs, attributes
    return ({k: inputs.get(k) for k in CACHE_INPUTS},
            {k: v for k, v in attributes.items() if k in CACHE_ATTRIBUTES})


def _value(array: np.ndarray, index) -> str:
    """One element, readable, with its bits for floats (``0.5 (0x3800)``)."""
    value = array[index]
    if array.dtype == INT4 or array.dtype.kind in "iub":
        return str(int(value))
    bits = np.asarray(value).view(f"u{array.dtype.itemsize}")
    return f"{float(value)!r} (0x{int(bits):0{2 * array.dtype.itemsize}x})"


def _index(index) -> str:
    return "[" + ", ".join(str(int(i)) for i in index) + "]"


def _first(mask: np.ndarray):
    return np.unravel_index(int(np.flatnonzero(mask)[0]), mask.shape)


class _Context:
    """The call being compared, and what is needed to describe a quantized KeyValueCache element."""

    def __init__(self, op, inputs, attributes, expected, got):
        self.op, self.inputs, self.attributes = op, inputs, attributes
        self.expected, self.got = expected, got
        self.quantized = op in CACHE_OPS and int(attributes.get("quant_bit", 0)) != 0
        self._slots = None
        # The attention output's bound: the expected outcome's, unless the output is expected over the backend's
        # cache (over_backend_cache).
        self.attention_tolerance = expected.tolerance
        self.over_backend_cache = False
        self.attention_keys = None  # the (key, value) the bound is over, where not the reference's gathered ones

    @property
    def slots(self):
        """The call's SlotMap (None when it cannot be built)."""
        if self._slots is None and self.op in CACHE_OPS:
            from .slot_map import SlotMap

            try:
                self._slots = SlotMap(*cache_call(self.op, self.inputs, self.attributes))
            except Exception:  # noqa: BLE001 - only used to describe a difference
                self._slots = False
        return self._slots or None

    def has_pairs(self) -> bool:
        """True when both outcomes hold a cache and scale of the expected dtype and shape."""
        return all(_same_form(self.got.after.get(n), self.expected.after.get(n)) for n in ("cache", "scale"))

    def pairs(self, kv: int) -> tuple:
        """((code', scale'), (code, scale)) behind every element of output ``kv``: the backend's, the spec's."""
        cache_index, scale_index = self.slots.source(kv), self.slots.source(kv, scale=True)
        result = []
        for outcome in (self.got, self.expected):
            codes = np.asarray(outcome.after["cache"]).astype(np.int8).reshape(-1)
            scales = np.asarray(outcome.after["scale"]).astype(np.float64).reshape(-1)
            result.append((codes[cache_index], scales[scale_index]))
        return tuple(result)

    def detail(self, name: str, index) -> str:
        """What is behind element ``index`` of tensor ``name``: for a KeyValueCache output, the cache slot (and
        quantized: code and scale) it is loaded from, and whether the backend's cache holds the expected contents
        there (then the backend read another slot, or did not read the cache); for a quantized cache element, the
        scale of its group."""
        if self.op != "KeyValueCache" or self.slots is None or \
                not (self.has_pairs() if self.quantized else _same_form(self.got.after.get("cache"),
                                                                          self.expected.after.get("cache"))):
            return ""
        got_cache, want_cache = self.got.after["cache"], self.expected.after["cache"]
        got_scale, want_scale = self.got.after.get("scale"), self.expected.after.get("scale")
        if name == "cache":
            if not self.quantized:
                return ""
            group = int(self.attributes.get("quant_group", 8))
            at = tuple(index[:-1]) + (index[-1] // group,)
            return f"; scale of its group: got {_value(got_scale, at)}, expected {_value(want_scale, at)}"
        if name not in ("key", "value"):
            return ""
        kv = 0 if name == "key" else 1
        code = np.unravel_index(int(self.slots.source(kv)[index]), got_cache.shape)
        text = f"; loaded from {self.slots.describe(kv, int(index[0]), int(index[1]))}"
        same = not bits_differ(np.asarray(got_cache[code]), np.asarray(want_cache[code])).any()
        if self.quantized:
            scale = np.unravel_index(int(self.slots.source(kv, scale=True)[index]), got_scale.shape)
            text += (f": code got {_value(got_cache, code)}, expected {_value(want_cache, code)}; scale got "
                     f"{_value(got_scale, scale)}, expected {_value(want_scale, scale)}")
            same = same and not bits_differ(np.asarray(got_scale[scale]), np.asarray(want_scale[scale])).any()
        if same:
            text += ("; the backend's cache holds the expected contents there: its load is wrong (another slot "
                     "read, or the stored value decoded otherwise)")
        return text


#: MultiHeadCacheAttention's inputs and attributes its attention takes: MultiHeadAttention's but the keys and values.
ATTENTION_INPUTS = tuple(n for n in mha_schema.INPUTS if n not in ("key", "value"))
ATTENTION_ATTRIBUTES = mha_schema.REQUIRED_ATTRIBUTES + tuple(mha_schema.ATTRIBUTE_DEFAULTS)


def _stored_inputs(ctx: "_Context") -> np.ndarray:
    """float64 array of the cache's shape: at each element the call stores, the input value stored there
    (current_key / current_value as float32, through the reference's unquantized store into a float32 cache)."""
    from ..reference import key_value_cache

    inputs, attributes = cache_call(ctx.op, ctx.inputs, ctx.attributes)
    # Only the cache is written: a float32 one of the cache's shape, the rest read as given.
    fresh = dict(inputs, current_key=np.asarray(inputs["current_key"]).astype(np.float32),
                 current_value=np.asarray(inputs["current_value"]).astype(np.float32),
                 cache=np.zeros(np.shape(inputs["cache"]), np.float32), scale=None)
    with np.errstate(all="ignore"):
        key_value_cache(**fresh, **dict(attributes, quant_bit=0))
    return fresh["cache"].astype(np.float64)


def _unexplained_codes(ctx: "_Context", values: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Mask over the cache of the stored codes that are not their input value over the backend's own stored scale,
    clipped to [-qmax, qmax] and rounded to nearest, within the rounding of a quotient computed in float16 (ppl's
    CUDA kernels) or in T1 (ppl's torch reference; bfloat16 the coarser), the quotient's move when the scale it
    divided by was the stored one before its rounding to T3 (ppl's torch reference: |q| ulp_T3(scale') / scale',
    large for a float16 scale in the subnormal range), plus 2^-10; where the quotient is not finite (special values)
    the reference's code is the only one. The tolerance table's other arithmetic rounds to nearest too: a code
    biased by one (rounded up, truncated) is not in it. ``values``: :func:`_stored_inputs`; ``stored``: the mask of
    the elements the call stores."""
    qmax = QMAX[int(ctx.attributes["quant_bit"])]
    group = int(ctx.attributes.get("quant_group", 8))
    codes = np.asarray(ctx.got.after["cache"]).astype(np.float64)
    want = np.asarray(ctx.expected.after["cache"]).astype(np.float64)
    scales = np.repeat(np.asarray(ctx.got.after["scale"]).astype(np.float64), group, axis=-1)
    t1 = np.asarray(ctx.inputs["current_key"]).dtype
    quotient_type = t1 if t1 == BFLOAT16 else np.float16
    scale_rounding = spec_tolerance.ulp(scales, ctx.got.after["scale"].dtype)
    with np.errstate(all="ignore"):
        quotient = values / scales
        clipped = np.clip(quotient, -qmax, qmax)
        slack = spec_tolerance.ulp(clipped, quotient_type) + np.abs(clipped) * scale_rounding / scales + 2.0 ** -10
        near = np.abs(codes - clipped) <= 0.5 + slack
    explained = np.where(np.isfinite(quotient), near & (np.abs(codes) <= qmax), codes == want)
    return stored & ~explained


def _unexplained_line(ctx: "_Context", unexplained: np.ndarray, values: np.ndarray, stored: np.ndarray) -> str:
    """The line saying which stored codes no rounding to nearest over the backend's own scales explains."""
    index = _first(unexplained)
    group = int(ctx.attributes.get("quant_group", 8))
    scale = ctx.got.after["scale"][tuple(index[:-1]) + (index[-1] // group,)]
    value = float(values[index])
    return (f"cache: {int(unexplained.sum())} of {int(stored.sum())} stored codes are not their input "
            f"over the backend's own scale rounded to nearest; first at {_index(index)}: code got "
            f"{_value(ctx.got.after['cache'], index)}, expected {_value(ctx.expected.after['cache'], index)}, input "
            f"{value!r} over scale {float(scale)!r} = {value / float(scale)!r} (the tolerance table's arithmetic rounds "
            "to nearest; a code rounded up, truncated or biased is outside it)")


def _attention_over_backend_cache(ctx: "_Context", dequantized_in=np.float32) -> tuple:
    """(output, tolerance) of MultiHeadCacheAttention over the keys and values the backend's cache holds: its codes
    and scales at the slots the call reads, dequantized as the spec does (float32 product, one rounding to T1) or,
    with ``dequantized_in`` the scale's dtype, as the tolerance table's ppl torch row does (the product in T3, then
    T1), then the reference's attention and twice its bound, as for the reference's own cache; the keys and values
    are left in ``ctx.attention_keys``."""
    from ..reference import attention_tolerance, multi_head_attention
    from ..reference.quantize import dequantize

    t1 = np.asarray(ctx.inputs["query"]).dtype
    # Each element's own scale (pairs gathers one per element): groups of one. A float32 product rounded to float16 is
    # float16's own product (a code of 8 bits times a scale of 11 is exact in float32).
    key, value = (dequantize(*ctx.pairs(kv)[0], 1, dequantized_in).astype(t1) for kv in (0, 1))
    call = {k: ctx.inputs.get(k) for k in ATTENTION_INPUTS}
    attributes = {k: v for k, v in ctx.attributes.items() if k in ATTENTION_ATTRIBUTES}
    with np.errstate(all="ignore"):  # non-finite inputs have defined outcomes (the reference's own calls do this)
        output = multi_head_attention(key=key, value=value, **call, **attributes)
        bound = 2 * attention_tolerance(key=key, value=value, **call, **attributes)
    ctx.attention_keys = (key, value)
    return output, bound


def _same_form(got, want) -> bool:
    return got is not None and want is not None and np.asarray(got).dtype == want.dtype and np.shape(got) == want.shape


def _outside(ctx: _Context, name: str, got: np.ndarray, want: np.ndarray, tolerance: str) -> np.ndarray:
    """Mask of the elements of ``name`` outside what the mode accepts."""
    if ctx.op in ATTENTION_OUTPUTS and name == ATTENTION_OUTPUTS[ctx.op]:
        g = got.astype(np.float64)
        outside = _attention_outside(g, want.astype(np.float64), ctx.attention_tolerance)
        return _outside_float32_range(ctx, g, outside) if outside.any() else outside
    if ctx.op in CACHE_OPS and not ctx.quantized and name in ("cache", "key", "value"):
        return bits_differ(got, want, nan_payloads=True)  # unquantized data movement is exact, a NaN's bits too
    if tolerance == "exact" or not ctx.quantized or ctx.slots is None:
        return _bits_outside(ctx, name, got, want)
    if name in ("cache", "scale"):
        stored = ctx.slots.stored(scale=name == "scale")
        if name == "cache":
            return spec_tolerance.codes_outside(got.astype(np.int8), want.astype(np.int8), stored)
        return spec_tolerance.scales_outside(got, want, stored, ctx.inputs["current_key"].dtype)
    if not ctx.has_pairs():  # no usable cache from the backend: only rounding is allowed (its cache fails apart)
        pair = (np.zeros(want.shape), np.zeros(want.shape))
        return spec_tolerance.outputs_outside(got, want, pair, pair, ctx.expected.after["scale"].dtype, own=False)
    got_pair, want_pair = ctx.pairs(0 if name == "key" else 1)
    return spec_tolerance.outputs_outside(got, want, got_pair, want_pair, ctx.expected.after["scale"].dtype)


def _written(ctx: _Context, name: str):
    """Mask of the elements of the in-place tensor ``name`` the call writes (KeyValueCache's stored slots, the rotated
    slots' key rows); None where that is not known."""
    if name not in ("cache", "scale") or not _same_form(ctx.got.after.get(name), ctx.expected.after.get(name)):
        return None
    if ctx.op in CACHE_OPS:
        if ctx.slots is None:
            return None
        if name == "scale" and ctx.slots.scale_shape is None:  # not quantized: the call writes no scale
            return np.zeros(ctx.expected.after[name].shape, bool)
        return ctx.slots.stored(scale=name == "scale")
    if ctx.op == "KeyCacheRotaryShift":
        from ..reference.layout import canonical_view

        mask = np.zeros(ctx.expected.after[name].shape, bool)
        if mask.ndim != 5 or (name == "scale" and not int(ctx.attributes.get("quant_bit", 0))):
            return mask  # an unquantized call's scale placeholder: never written
        slots = np.asarray(ctx.inputs["slots"], np.int64)
        canonical_view(mask, int(ctx.attributes.get("cache_layout", 0)))[int(ctx.attributes.get("layer_idx", 0)), 0][
            :, slots, :] = True
        return mask
    return None


def _bits_outside(ctx: _Context, name: str, got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elements whose bits differ. A NaN the call computes may have any payload; an element the call leaves (every
    other slot, head and layer) keeps every bit, a NaN's payload too."""
    loose, strict = bits_differ(got, want), bits_differ(got, want, nan_payloads=True)
    if not (strict & ~loose).any():  # no NaN payload differs: where the call writes does not matter
        return loose
    written = _written(ctx, name)
    return loose if written is None else np.where(written, loose, strict)


def _outside_float32_range(ctx: _Context, g: np.ndarray, outside: np.ndarray) -> np.ndarray:
    """``outside`` with the rows outside float32's range (spec "Tolerance") judged as the spec judges them: there one
    order of the float32 arithmetic may overflow where another does not, so the reference's elements do not bind; each
    element is non-finite, or within the bound of the exact value (float64); where that is not finite, non-finite
    (an infinity of its sign, or NaN)."""
    from ..reference import attention_exact, key_value_cache

    if g.ndim != 3:
        return outside
    call = {k: ctx.inputs.get(k) for k in ATTENTION_INPUTS}
    attributes = {k: v for k, v in ctx.attributes.items() if k in ATTENTION_ATTRIBUTES}
    try:
        if ctx.op == "MultiHeadAttention":
            keys = {"key": ctx.inputs["key"], "value": ctx.inputs["value"]}
        elif ctx.attention_keys is not None:  # the bound is over the backend's own cache
            keys = dict(zip(("key", "value"), ctx.attention_keys))
        else:  # the keys and values the reference gathers, on copies
            inputs, cache_attributes = cache_call(ctx.op, ctx.inputs, ctx.attributes)
            keys = dict(zip(("key", "value"), key_value_cache(**copies(inputs), **cache_attributes)))
        exact, rows = attention_exact(**keys, **call, **attributes)
    except Exception:  # noqa: BLE001 - only relaxes what the reference's elements would fail
        return outside
    if not rows.any():
        return outside
    bound = ctx.attention_tolerance / 2  # the vectors record twice the bound: two backends' distance
    with np.errstate(invalid="ignore"):
        within = np.abs(g - exact) <= bound
    wrong_infinity = np.isinf(exact) & np.isinf(g) & (g != exact)
    passes = np.where(np.isfinite(exact), ~np.isfinite(g) | within, ~np.isfinite(g) & ~wrong_infinity)
    return np.where(rows[:, :, None], ~passes, outside)


def _attention_outside(g: np.ndarray, w: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Mask of the attention output's elements outside what the spec accepts (float64 arrays ``[T, H, D]``).

    In a row (one query, one head) the reference holds a non-finite element in, the spec ("Non-finite values")
    leaves open whether each is NaN or an infinity, and whether other elements of the row are non-finite too: the
    backend's element is non-finite wherever the reference's is (where that is an infinity, NaN or the same infinity),
    and its elements finite on both sides with a finite bound stay within it. In every other row a non-finite element
    on either side must be the same on both (NaN any NaN): inf - inf is NaN, which no bound admits, and where the
    reference is infinite its bound is too, which would admit any value."""
    special, differs = special_values(g, w)
    with np.errstate(invalid="ignore"):
        outside = ~(np.abs(g - w) <= bound)
    if g.ndim == 0:
        return np.where(special, differs, outside)
    open_rows = ~np.isfinite(w).all(axis=-1, keepdims=True)
    finite = np.isfinite(g) & np.isfinite(w) & np.isfinite(bound)
    # Non-finite where the reference is; an infinity of its sign or NaN (a weight that underflows to 0 makes one NaN)
    in_open_rows = (finite & outside) | (np.isfinite(g) & ~np.isfinite(w)) | (np.isinf(w) & np.isinf(g) & (g != w))
    return np.where(open_rows, in_open_rows, np.where(special, differs, outside))


def _tensor_lines(ctx: _Context, name: str, got, want, tolerance: str, unchanged=False) -> list:
    if got is None:
        return [f"{name}: the backend returned no {name}"]
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return [f"{name}: got {got.dtype.name}{list(got.shape)}, expected {want.dtype.name}{list(want.shape)}"]
    # byte for byte after an error (nothing may be written)
    mask = bits_differ(got, want, nan_payloads=True) if unchanged else _outside(ctx, name, got, want, tolerance)
    count = int(np.count_nonzero(mask))
    if not count:
        return []
    index = _first(mask)
    attention = ATTENTION_OUTPUTS.get(ctx.op) == name
    tolerant = attention or (tolerance == "spec" and ctx.quantized and ctx.slots is not None)
    what = "outside the tolerance" if tolerant else "differ"
    if unchanged:
        what = "changed although the call failed"
    line = (f"{name}: {count} of {mask.size} elements {what}; first at {_index(index)}: got {_value(got, index)}, "
            f"expected {_value(want, index)}")
    if attention:
        line += f" (tolerance {float(ctx.attention_tolerance[index]):.3g})"
        if ctx.over_backend_cache:
            line += "; expected: the attention over the keys and values in the backend's cache, which passes"
    return [line + ctx.detail(name, index)]


def compare(op: str, inputs: dict, attributes: dict, expected: Outcome, got: Outcome, tolerance: str = "exact") -> list:
    """The problems with ``got`` against ``expected`` for the call (``inputs`` as given to it, by formal name),
    one line each; an empty list when the backend passes."""
    if tolerance not in TOLERANCES:
        raise ValueError(f"tolerance must be one of {TOLERANCES}, got {tolerance!r}")
    if got.crashed:
        return [got.error]
    changed = list(got.changed_inputs)
    ctx = _Context(op, inputs, attributes, expected, got)
    if expected.error is not None:
        if got.error is None:
            return changed + [f"accepted an invalid call; expected an error (the reference: {expected.error})"]
        lines = changed
        for name, want in expected.after.items():
            lines += _tensor_lines(ctx, name, got.after.get(name), want, tolerance, unchanged=True)
        return lines
    if got.error is not None:
        return changed + [f"raised {got.error}"]
    lines = changed
    after_lines = {name: _tensor_lines(ctx, name, got.after.get(name), want, tolerance)
                   for name, want in expected.after.items()}
    outputs, alternative = dict(expected.outputs), None
    if (tolerance == "spec" and ctx.quantized and ctx.slots is not None and ctx.has_pairs()
            and not any(after_lines.values())):
        values, stored = _stored_inputs(ctx), ctx.slots.stored()
        unexplained = _unexplained_codes(ctx, values, stored)
        if unexplained.any():
            after_lines["cache"].append(_unexplained_line(ctx, unexplained, values, stored))
        elif op == "MultiHeadCacheAttention":
            if any(bits_differ(np.asarray(got.after[n]), expected.after[n]).any() for n in ("cache", "scale")):
                # The backend's cache passes the table, is not the reference's, and quantizes faithfully with its
                # own scales: its attention is over its own keys.
                outputs["output"], ctx.attention_tolerance = _attention_over_backend_cache(ctx)
                ctx.over_backend_cache = True
            if expected.after["scale"].dtype != np.float32:
                alternative = expected.after["scale"].dtype  # the table's ppl torch row dequantizes in T3
    for name, want in outputs.items():
        found = _tensor_lines(ctx, name, got.outputs.get(name), want, tolerance)
        if found and alternative is not None and name == "output":
            primary = ctx.attention_tolerance, ctx.attention_keys
            in_t3, ctx.attention_tolerance = _attention_over_backend_cache(ctx, alternative)
            if not _tensor_lines(ctx, name, got.outputs.get(name), in_t3, tolerance):  # only whether it passes
                found = []  # the attention over its keys dequantized in T3, which the table allows
            ctx.attention_tolerance, ctx.attention_keys = primary
        lines += found
    for name, want in expected.after.items():
        problems = after_lines[name]
        before = inputs.get(name)
        if problems and before is not None and _same_form(got.after.get(name), before) and \
                not bits_differ(np.asarray(got.after[name]), before).any() and bits_differ(want, before).any():
            problems.append(f"{name}: left exactly as it was given: the op writes {name} in place, in the caller's "
                            "array (a backend that stores into a copy, or returns a new array, fails every store)")
        lines += problems
    return lines
