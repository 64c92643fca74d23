"""What the serving benchmarks share at the end of a run: the command line that made it, and its table printed and
written beside its JSON."""

from __future__ import annotations

import json
import sys


def command_line(module: str, argv) -> str:
    """``python -m MODULE ARGS`` as it was run (``argv`` None: the process's own arguments)."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def publish(out, title: str, result: dict, text: str) -> None:
    """Prints ``text``; with ``out``, writes ``result`` as results.json and ``# title`` + ``text`` as README.md."""
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "README.md").write_text(f"# {title}\n\n" + text)
