"""Whether a process the tests started (or that a tested program left) still runs, read from /proc; a script run in
a fresh interpreter (for limits, such as RLIMIT_AS, that must not touch the test process)."""

import subprocess
import sys
import textwrap
import time


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ended_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not running(pid)


def run_script(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs the Python ``script`` (dedented) in a fresh interpreter, stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout)
