"""Whether a process the tests started (or that a tested program left) still runs, read from /proc."""

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
