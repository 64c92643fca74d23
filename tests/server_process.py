"""``kvcache-op serve`` as a subprocess on a free loopback port, bounded in time (``--stop-after``) and stopped by
the test that started it."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time

import pytest

START_TIMEOUT_S = 180  # a checkpoint folder is exported first
LIFETIME_S = 900  # the server stops by itself after this, whatever happens to the test run


@contextlib.contextmanager
def running_server(model, *args):
    """Yields the server's base URL (``http://127.0.0.1:PORT``) once it accepts connections; its output is kept
    in ``running_server.output`` for failures."""
    command = [sys.executable, "-m", "kvcache_op", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
               "--stop-after", str(LIFETIME_S), *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, found = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if "listening on http://" in line:
                found.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    began = time.monotonic()
    while not found.is_set() and process.poll() is None and time.monotonic() - began < START_TIMEOUT_S:
        found.wait(0.1)
    try:
        if not found.is_set():
            pytest.fail(f"the server did not start (exit {process.poll()}):\n{''.join(lines)[-3000:]}")
        url = re.search(r"listening on (http://\S+)", "".join(lines)).group(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        reader.join(5)
        running_server.output = "".join(lines)
