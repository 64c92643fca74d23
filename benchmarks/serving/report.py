"""What the serving benchmarks share: their requests' arrival times and pages, the check that the requests fit the
engine before anything slow starts, and the table printed and written beside its JSON."""

from __future__ import annotations

import json

import numpy as np

#: The exporter's default page size, which the serving benchmarks' engines take.
PAGE_SIZE = 16


def pages_for(tokens: int) -> int:
    """The pages of :data:`PAGE_SIZE` that ``tokens`` positions take."""
    return -(-tokens // PAGE_SIZE)


def arrivals(requests: int, rate: float, seed: int = 1) -> np.ndarray:
    """The send times (s from the start) of ``requests`` Poisson arrivals at ``rate`` per second."""
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, requests))


def check_fits(parser, prompt_tokens: int, new_tokens: int, num_pages: int, max_positions: int) -> None:
    """Refuses (``parser.error``: one line, before the export) requests of ``prompt_tokens`` + ``new_tokens`` that
    the engine would refuse only after the export and the server or engine had started: past the model's
    ``max_positions``, or holding more pages of :data:`PAGE_SIZE` than ``num_pages``."""
    if prompt_tokens + new_tokens > max_positions:
        parser.error(f"{prompt_tokens} prompt tokens + {new_tokens} new tokens exceed the model's {max_positions} "
                     f"positions")
    needed = pages_for(prompt_tokens + new_tokens - 1)  # the last token is never fed back
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
