"""Command-line argument types and checks shared by ``kvcache-op`` and the benchmarks: errors are one line on stderr
with exit status 2, numbers are checked by argparse before any work, and an output folder is tried first."""

import argparse

#: The largest cache page an export takes (kvcache_op.hf.export.MAX_PAGE_SIZE, here without importing torch).
MAX_PAGE_SIZE = 4096


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (``kvcache-op CMD: error: ...``), exit status 2."""

    def error(self, message):
        """One line on stderr, exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def at_least(low: int, high: int = None):
    """An argparse type: an integer >= ``low`` (and <= ``high`` where given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    return parse


def writable_folder_problem(path) -> str:
    """Why a folder cannot be made (or written) at ``path``, or "" when it can: the nearest existing folder on
    the way must take a new entry, which is tried (a permission check alone says yes to root, even in /proc)."""
    import pathlib
    import tempfile

    target = pathlib.Path(path)
    if target.exists() and not target.is_dir():
        return f"{path} exists and is not a folder"
    ancestor = target if target.exists() else next((p for p in target.absolute().parents if p.exists()), None)
    if ancestor is None or not ancestor.is_dir():
        return f"{ancestor} is not a folder"
    try:
        tempfile.TemporaryDirectory(dir=ancestor).cleanup()
    except OSError as error:
        return f"cannot write in {ancestor}: {error.strerror or error}"
    return ""


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def out_folder(text: str):
    """An argparse type: a folder the command can create or write (see :func:`writable_folder_problem`)."""
    import pathlib

    problem = writable_folder_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return pathlib.Path(text)


def library_file(text: str) -> str:
    """An argparse type: an existing file (a shared library to load), as an absolute path."""
    import pathlib

    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return str(path.resolve())


def absolute_path(text: str) -> str:
    """An argparse type: ``text`` as an absolute path, checked later (a library loader given a bare file name
    searches its own path, not the current folder)."""
    import os

    return os.path.abspath(text)
