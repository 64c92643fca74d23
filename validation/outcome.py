"""What a call of one of the ops does, as data: its outputs and in-place results, or its error.

:func:`reference_outcome` is the reference's outcome of a call; conformance vectors record it, and the
validator and the fuzzer compare a backend's :class:`Outcome` with it.
"""

import dataclasses

import numpy as np

#: The inputs each op writes in place (in node order).
IN_PLACE = {"KeyValueCache": ("cache", "scale"), "KeyCacheRotaryShift": ("cache", "scale"), "MultiHeadAttention": (),
            "MultiHeadCacheAttention": ("cache", "scale")}
#: Each op's outputs (in node order).
OUTPUTS = {"KeyValueCache": ("key", "value"), "KeyCacheRotaryShift": ("slots_out",),
           "MultiHeadAttention": ("attention_output",), "MultiHeadCacheAttention": ("output",)}


#: Per op, the inputs no output may share memory with (the specs' aliasing rules: KeyValueCache's outputs share no
#: byte with cache, scale, current_key or current_value, nor MultiHeadCacheAttention's, which keeps every rule of
#: KeyValueCache; KeyCacheRotaryShift's slots_out none with cache or scale).
UNSHARED_WITH_OUTPUTS = {"KeyValueCache": ("cache", "scale", "current_key", "current_value"),
                         "KeyCacheRotaryShift": ("cache", "scale"), "MultiHeadAttention": (),
                         "MultiHeadCacheAttention": ("cache", "scale", "current_key", "current_value")}


def shared_memory(op: str, inputs: dict, outputs: dict) -> tuple:
    """One line per output of ``op`` sharing memory with an input it may not (:data:`UNSHARED_WITH_OUTPUTS`) or with
    another output: the caller's next write to one would change the other."""
    lines = []
    for k, (name, output) in enumerate(outputs.items()):
        if not isinstance(output, np.ndarray) or not output.size:
            continue
        others = [(f"input {n}", inputs.get(n)) for n in UNSHARED_WITH_OUTPUTS[op]]
        others += [(f"output {n}", o) for n, o in list(outputs.items())[k + 1:]]
        for what, other in others:
            if isinstance(other, np.ndarray) and other.size and np.shares_memory(output, other):
                lines.append(f"{name}: the backend's output shares memory with {what}; the spec gives each output "
                             "its own memory")
    return tuple(lines)


@dataclasses.dataclass
class Outcome:
    """``outputs`` (output name -> array; None after an error), ``after`` (in-place input name -> its contents
    after the call), ``error`` (the message, None on success), ``tolerance`` (attention: the bound of every
    output element), ``crashed`` (the backend's process died, or it tried to end it), ``changed_inputs`` (one
line per input other than ``cache``/``scale`` that the backend changed: they are read-only; and per memory the
backend may not touch or share: an earlier call's cache, an output on an input), ``timed_out`` (crashed: it did
not return within the worker's timeout)."""

    outputs: dict = None
    after: dict = dataclasses.field(default_factory=dict)
    error: str = None
    tolerance: np.ndarray = None
    crashed: bool = False
    changed_inputs: tuple = ()
    timed_out: bool = False


def copies(inputs: dict) -> dict:
    """Fresh copies of a call's inputs (None stays None)."""
    return {k: (None if v is None else np.array(v, copy=True)) for k, v in inputs.items()}


def in_place_after(op: str, inputs: dict) -> dict:
    """The in-place inputs of ``op`` present in ``inputs`` (their current contents, not copied)."""
    return {name: inputs[name] for name in IN_PLACE[op] if inputs.get(name) is not None}


def _bytes_differ(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Per element of two arrays of one dtype and shape: does any of its bytes differ (a NaN's payload too)."""
    def as_bytes(array):
        return np.ascontiguousarray(array).view(np.uint8).reshape(array.shape + (array.dtype.itemsize,))

    return (as_bytes(got) != as_bytes(want)).any(axis=-1)


def read_only_changes(op: str, before: dict, after: dict) -> tuple:
    """One line per input of ``op`` other than its in-place ones that differs between ``before`` (what the call
    was given) and ``after`` (the same arrays once the call returned): presence, dtype, shape or any bit."""
    lines = []
    for name, want in before.items():
        if name in IN_PLACE[op]:
            continue
        got = after.get(name)
        if want is None or got is None:
            if (want is None) != (got is None):
                lines.append(f"{name}: the backend changed this read-only input ({'removed' if got is None else 'added'})")
            continue
        want, got = np.asarray(want), np.asarray(got)
        if got.dtype != want.dtype or got.shape != want.shape:
            lines.append(f"{name}: the backend changed this read-only input to {got.dtype.name}{list(got.shape)} "
                         f"(was {want.dtype.name}{list(want.shape)})")
        elif (differ := _bytes_differ(got, want)).any():
            index = np.argwhere(differ)[0]
            at = ", ".join(map(str, index))
            lines.append(f"{name}: the backend changed this read-only input; first at [{at}]: now {got[tuple(index)]!r}, "
                         f"was {want[tuple(index)]!r}")
    return tuple(lines)


def run_on_copies(backend, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
    """Runs one call of ``backend`` on fresh copies of ``inputs`` (which stay as they are) and notes every
    read-only input the backend changed (in this process; a worker process notes its own)."""
    given = copies(inputs)
    got = backend.run(op, given, attributes, model)
    got.changed_inputs = tuple(dict.fromkeys(tuple(got.changed_inputs) + read_only_changes(op, inputs, given)))
    return got


def reference_outcome(op: str, inputs: dict, attributes: dict) -> Outcome:
    """Runs the reference on copies of ``inputs``; an invalid call is an Outcome with ``error`` set and the
    in-place inputs as they were (the reference writes nothing before raising)."""
    from ..reference import (KeyValueCacheError, attention_tolerance, cache_attention_tolerance, key_cache_rotary_shift,
                             key_value_cache, multi_head_attention, multi_head_cache_attention)

    fresh = copies(inputs)
    try:
        if op == "KeyValueCache":
            key, value = key_value_cache(**fresh, **attributes)
            outputs = {"key": key, "value": value}
        elif op == "KeyCacheRotaryShift":
            outputs = {"slots_out": key_cache_rotary_shift(**fresh, **attributes)}
        elif op == "MultiHeadCacheAttention":
            before = copies(inputs)
            output = multi_head_cache_attention(**fresh, **attributes)
            # Twice the spec's bound, over the keys and values the call gathers (computed on untouched copies).
            return Outcome({"output": output}, in_place_after(op, fresh),
                           tolerance=2 * cache_attention_tolerance(**before, **attributes))
        else:
            output = multi_head_attention(**fresh, **attributes)
            # Twice the spec's bound: the reference is itself within the bound of the exact result.
            tolerance = 2 * attention_tolerance(**fresh, **attributes)
            return Outcome({"attention_output": output}, {}, tolerance=tolerance)
    except KeyValueCacheError as error:  # MultiHeadAttentionError is one too
        return Outcome(None, in_place_after(op, fresh), error=str(error))
    return Outcome(outputs, in_place_after(op, fresh))
