"""What a call of one of the ops does, as data: its outputs and in-place results, or its error.

:func:`reference_outcome` is the reference's outcome of a call; conformance vectors record it, and the
validator and the fuzzer compare a backend's :class:`Outcome` with it.
"""

import dataclasses

import numpy as np

#: The inputs each op writes in place (in node order).
IN_PLACE = {"KeyValueCache": ("cache", "scale"), "KeyCacheRotaryShift": ("cache", "scale"), "MultiHeadAttention": ()}
#: Each op's outputs (in node order).
OUTPUTS = {"KeyValueCache": ("key", "value"), "KeyCacheRotaryShift": ("slots_out",),
           "MultiHeadAttention": ("attention_output",)}


@dataclasses.dataclass
class Outcome:
    """``outputs`` (output name -> array; None after an error), ``after`` (in-place input name -> its contents
    after the call), ``error`` (the message, None on success), ``tolerance`` (attention: the bound of every
    output element), ``crashed`` (the backend's process died)."""

    outputs: dict = None
    after: dict = dataclasses.field(default_factory=dict)
    error: str = None
    tolerance: np.ndarray = None
    crashed: bool = False


def copies(inputs: dict) -> dict:
    """Fresh copies of a call's inputs (None stays None)."""
    return {k: (None if v is None else np.array(v, copy=True)) for k, v in inputs.items()}


def in_place_after(op: str, inputs: dict) -> dict:
    """The in-place inputs of ``op`` present in ``inputs`` (their current contents, not copied)."""
    return {name: inputs[name] for name in IN_PLACE[op] if inputs.get(name) is not None}


def reference_outcome(op: str, inputs: dict, attributes: dict) -> Outcome:
    """Runs the reference on copies of ``inputs``; an invalid call is an Outcome with ``error`` set and the
    in-place inputs as they were (the reference writes nothing before raising)."""
    from ..reference import (KeyValueCacheError, attention_tolerance, key_cache_rotary_shift, key_value_cache,
                             multi_head_attention)

    fresh = copies(inputs)
    try:
        if op == "KeyValueCache":
            key, value = key_value_cache(**fresh, **attributes)
            outputs = {"key": key, "value": value}
        elif op == "KeyCacheRotaryShift":
            outputs = {"slots_out": key_cache_rotary_shift(**fresh, **attributes)}
        else:
            output = multi_head_attention(**fresh, **attributes)
            # Twice the spec's bound: the reference is itself within the bound of the exact result.
            tolerance = 2 * attention_tolerance(**fresh, **attributes)
            return Outcome({"attention_output": output}, {}, tolerance=tolerance)
    except KeyValueCacheError as error:  # MultiHeadAttentionError is one too
        return Outcome(None, in_place_after(op, fresh), error=str(error))
    return Outcome(outputs, in_place_after(op, fresh))
