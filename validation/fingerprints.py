"""Fingerprints of the conformance cases' definitions, committed in ``spec/conformance_cases.json``, so that a case
changes only on purpose: only a sample of the cases is committed as vectors (``spec/conformance/``), and a case that
quietly stopped being what its name says (a scalar ``max_seqlen`` in ``max_len_shape1``, a special value gone from
``quant_special_values``) would still pass every backend.

A fingerprint covers what is the same on every machine: the op, its attributes, whether the call is invalid, every
input's dtype and shape, the values of the index inputs, and how many NaN, +inf and -inf each floating input holds.
Floating values themselves are left out (a case may derive them through ``sin``/``cos``, whose last bits differ
between numpy's vector paths); the committed vectors and the cross-backend tests check values.

``python -m kvcache_op.validation.fingerprints spec/conformance_cases.json``, from the repository's root, rewrites
the committed file after a deliberate change and names the cases that changed (without a path: the installed
package's copy, which is what the tests read).
"""

import json
import pathlib
import sys

from .case_fingerprint import case_fingerprint

COMMITTED_FILE = pathlib.Path(__file__).resolve().parent.parent / "spec" / "conformance_cases.json"


def fingerprints() -> dict:
    """Every conformance case's fingerprint, by name, in the kit's order."""
    from .vectors import ALL_CASES

    return {name: case_fingerprint(make()) for name, make in ALL_CASES.items()}


def committed() -> dict:
    """The fingerprints committed in ``spec/conformance_cases.json``."""
    return json.loads(COMMITTED_FILE.read_text())


def differences(want: dict, got: dict) -> list:
    """One line per case added, removed or changed between two fingerprint maps (empty: the same)."""
    lines = [f"added: {name}" for name in got if name not in want]
    lines += [f"removed: {name}" for name in want if name not in got]
    lines += [f"changed: {name}" for name in got if name in want and got[name] != want[name]]
    return lines


def main(argv=None) -> int:
    """Rewrites the fingerprint file (``argv[0]``, default the installed package's) from the cases as they are now;
    prints what changed and where it wrote."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1:
        print("usage: python -m kvcache_op.validation.fingerprints [spec/conformance_cases.json]", file=sys.stderr)
        return 2
    path = pathlib.Path(argv[0]) if argv else COMMITTED_FILE
    old = json.loads(path.read_text()) if path.exists() else {}
    new = fingerprints()
    path.write_text(json.dumps(new, indent=0) + "\n")
    for line in differences(old, new) or ["no case changed"]:
        print(line)
    print(f"wrote {len(new)} fingerprints to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
