"""The fingerprint of one conformance case's definition (what :mod:`.fingerprints` commits for every case, and what
a written case folder records): the op, its attributes, whether the call is invalid, every input's dtype and
shape, the values of the index inputs, and how many NaN, +inf and -inf each floating input holds."""

import hashlib
import json

import numpy as np

INDEX_INPUTS = ("seqstarts", "kvstarts", "cachestarts", "start_pos", "max_seqlen", "max_kvlen", "decoding_batches",
                "slots")


def _floating(array) -> bool:
    return array.dtype.kind == "f" or array.dtype.name == "bfloat16"


def case_fingerprint(case) -> str:
    """A hex digest of ``case``'s definition as the module docstring says: equal on every machine for the same
    definition, different when an attribute, an input's dtype or shape, an index value, or the count of non-finite
    values of a floating input changes."""
    parts = [case.op, sorted((k, repr(v)) for k, v in case.attributes.items()), bool(case.expect_error)]
    for name, array in case.inputs.items():
        if array is None:
            parts.append((name, None))
            continue
        array = np.asarray(array)
        entry = [name, array.dtype.name, list(array.shape)]
        if name in INDEX_INPUTS:
            entry.append(hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest())
        elif _floating(array):
            with np.errstate(invalid="ignore"):  # a signaling NaN is counted as a NaN
                values = array.astype(np.float64)
            entry.append([int(np.isnan(values).sum()), int((values == np.inf).sum()), int((values == -np.inf).sum())])
        parts.append(entry)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
