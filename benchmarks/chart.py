"""The benchmarks' chart: two bars per case, written as a PNG when matplotlib is installed."""

import pathlib
import sys


def paired_bar_chart(path: pathlib.Path, labels, left: tuple, right: tuple, ylabel: str, title: str,
                     reference_line: float | None = None) -> bool:
    """Writes ``path``: per label, bars ``left`` and ``right`` (each ``(legend, values)``), with a dashed line at
    ``reference_line`` when given. Returns False (and says so on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no chart written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.7), 4.5))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, list(left[1]), 0.4, label=left[0])
    ax.bar(x + 0.2, list(right[1]), 0.4, label=right[0])
    if reference_line is not None:
        ax.axhline(reference_line, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
