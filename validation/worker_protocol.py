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


def _read_exactly(fd: int, count: int, deadline=None) -> bytes:
    """``count`` bytes from ``fd``; EOFError when it closes first, TimeoutError past ``deadline``."""
    chunks, left = [], count
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline=None):
    """The next message on ``fd``; EOFError when it closes, TimeoutError past ``deadline`` (monotonic seconds)."""
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))
