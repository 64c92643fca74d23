"""The wire format between a validation run and its backend worker: length-prefixed pickles."""

import os
import pickle
import select
import struct
import time

_HEADER = struct.Struct("<Q")


def send(stream, obj) -> None:
    """Writes ``obj`` to ``stream`` as one message."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


#: How often a wait for the worker's answer checks that the worker still lives (seconds).
_POLL = 0.25


def _read_exactly(fd: int, count: int, deadline=None, alive=None) -> bytes:
    """``count`` bytes from ``fd``; EOFError when it closes first, or when ``alive()`` says the writer died with
    nothing more written (a child it forked may hold the pipe open); TimeoutError past ``deadline``."""
    chunks, left = [], count
    while left:
        while deadline is not None or alive is not None:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise TimeoutError
            if alive is not None:
                wait = _POLL if wait is None else min(wait, _POLL)
            if select.select([fd], [], [], wait)[0]:
                break
            if alive is not None and not alive() and not select.select([fd], [], [], 0)[0]:
                raise EOFError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline=None, alive=None):
    """The next message on ``fd``; EOFError when it closes or ``alive()`` turns false with nothing left to read,
    TimeoutError past ``deadline`` (monotonic seconds)."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline, alive))
    return pickle.loads(_read_exactly(fd, size, deadline, alive))
