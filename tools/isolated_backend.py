"""A backend run in a worker process, so that a crash or a hang fails only the call that caused it.

The worker (``python -m kvcache_op.tools.isolated_backend``) builds the backend once and runs calls one
after another; requests and answers are length-prefixed pickles on its stdin and on a private copy of its
stdout (the backend's own prints go to its stderr, kept in a file). When the worker dies or does not answer
within the timeout, the call is reported as crashed, with the end of the worker's stderr, and a fresh
worker serves the next call.
"""

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile

from ..spec.outcome import Outcome
from .backends import BackendLoadError, error_text

_HEADER = struct.Struct("<Q")


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exactly(fd: int, count: int, deadline=None) -> bytes:
    """``count`` bytes from ``fd``; EOFError when it closes first, TimeoutError past ``deadline``."""
    import time

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


def _receive(fd: int, deadline=None):
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    return pickle.loads(_read_exactly(fd, size, deadline))


def _describe_exit(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _crash_lines(stderr: str) -> list:
    """The telling part of a dead worker's stderr: faulthandler's fatal error and the innermost frames (where
    the backend was), else its last lines."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if not fatal:
        return lines[-4:]
    frames = [line for line in lines[fatal[-1] + 1:] if line.startswith("File ")]
    return [lines[fatal[-1]]] + frames[:3]


class IsolatedBackend:
    """The backend :func:`~kvcache_op.tools.backends.make_backend` builds from (``spec``, ``options``), in a
    worker process; ``timeout`` seconds per call. Raises :class:`BackendLoadError` when the worker cannot
    build it."""

    def __init__(self, spec: str, options: dict, timeout: float = 300.0):
        self.spec, self.options, self.timeout = spec, dict(options), timeout
        self._process = None
        self.ops, self.name = self._start()

    def _start(self):
        self._stderr = tempfile.TemporaryFile()
        self._process = subprocess.Popen([sys.executable, "-m", "kvcache_op.tools.isolated_backend"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        # The worker sees what this process sees: its sys.path (the current directory, PYTHONPATH, tests' helpers).
        try:
            _send(self._process.stdin, (list(sys.path), os.getcwd(), self.spec, self.options))
            ready = _receive(self._process.stdout.fileno(), None)
        except (EOFError, BrokenPipeError):
            raise BackendLoadError(f"--backend {self.spec}: the worker process {self._exit_text()}") from None
        if "error" in ready:
            self.close()
            raise BackendLoadError(ready["error"])
        return frozenset(ready["ops"]), ready["name"]

    def _exit_text(self) -> str:
        code = self._process.wait()
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace")
        self._stderr.close()
        return _describe_exit(code) + (": " + " | ".join(_crash_lines(text)) if text.strip() else "")

    def run(self, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
        """Runs the call in the worker; ``inputs``' in-place arrays receive what the backend left in them. A
        crash or timeout is an Outcome with ``crashed`` set (and ``after`` empty: the memory is gone)."""
        import time

        if self._process is None or self._process.poll() is not None:
            try:
                self._start()
            except BackendLoadError as error:  # it loaded before: say so for this call, and try again next time
                return self._crashed(f"the backend's worker could not be restarted: {error}")
        request = (op, inputs, attributes, None if model is None else model.SerializeToString())
        try:
            _send(self._process.stdin, request)
            answer = _receive(self._process.stdout.fileno(), time.monotonic() + self.timeout)
        except (EOFError, BrokenPipeError):
            return self._crashed(f"the backend crashed: its process {self._exit_text()}")
        except TimeoutError:
            self._process.kill()
            self._exit_text()
            return self._crashed(f"the backend did not return within {self.timeout:g} s (its process was killed)")
        for name, array in answer.after.items():
            inputs[name][...] = array
        answer.after = {name: inputs[name] for name in answer.after}
        return answer

    def _crashed(self, message: str) -> Outcome:
        self._process = None
        return Outcome(None, {}, error=message, crashed=True)

    def close(self):
        """Stops the worker."""
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None


def _worker() -> int:
    """The worker's loop: builds the backend, then answers one request at a time until stdin closes."""
    import onnx

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the backend's prints must not reach the answer pipe
    import faulthandler

    faulthandler.enable()  # a crash leaves a Python traceback in stderr, which the parent reports
    requests = sys.stdin.buffer.fileno()
    path, cwd, spec, options = _receive(requests)
    sys.path[:] = path
    os.chdir(cwd)
    from .backends import make_backend

    try:
        backend = make_backend(spec, options)
    except BackendLoadError as error:
        _send(answers, {"error": str(error)})
        return 1
    except Exception as error:  # noqa: BLE001
        _send(answers, {"error": f"--backend {spec}: {error_text(error)}"})
        return 1
    _send(answers, {"ops": sorted(backend.ops), "name": backend.name})
    while True:
        try:
            op, inputs, attributes, model = _receive(requests)
        except EOFError:
            return 0
        model = None if model is None else onnx.load_from_string(model)
        _send(answers, backend.run(op, inputs, attributes, model))


if __name__ == "__main__":
    sys.exit(_worker())
