"""What the serving benchmarks share: the command line that made a run, the check that its requests fit the
engine before anything slow starts, and its table printed and written beside its JSON."""

from __future__ import annotations

import json
import sys

from ..environment import recorded_command

#: The exporter's default page size, which the serving benchmarks' engines take.
PAGE_SIZE = 16


def command_line(module: str, argv) -> str:
    """``python -m MODULE ARGS`` as it was run (``argv`` None: the process's own arguments), every word
    shell-quoted behind the kernels' switches in force, so the line can be run again."""
    return recorded_command(module, list(sys.argv[1:] if argv is None else argv))


def check_fits(parser, prompt_tokens: int, new_tokens: int, num_pages: int, max_positions: int) -> None:
    """Refuses (``parser.error``: one line, before the export) requests of ``prompt_tokens`` + ``new_tokens`` that
    the engine would refuse only after the export and the server or engine had started: past the model's
    ``max_positions``, or holding more pages of :data:`PAGE_SIZE` than ``num_pages``."""
    if prompt_tokens + new_tokens > max_positions:
        parser.error(f"{prompt_tokens} prompt tokens + {new_tokens} new tokens exceed the model's {max_positions} "
                     f"positions")
    needed = -(-(prompt_tokens + new_tokens - 1) // PAGE_SIZE)
    if num_pages is not None and needed > num_pages:
        parser.error(f"{prompt_tokens} prompt tokens + {new_tokens} new tokens need {needed} pages of {PAGE_SIZE}, "
                     f"more than --num-pages {num_pages}")


def ms(value) -> str:
    """A latency in ms for a table, or "-" where there is none (no request gave one)."""
    return "-" if value is None else f"{value:.1f}"


def publish(out, title: str, result: dict, text: str) -> None:
    """Prints ``text``; with ``out``, writes ``result`` as results.json and ``# title`` + ``text`` as README.md."""
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "README.md").write_text(f"# {title}\n\n" + text)
