"""A backend run in a worker process, so that a crash or a hang fails only the call that caused it.

The worker (``python -m kvcache_op.validation.isolated_worker``) builds the backend once and runs calls one
after another; requests and answers are length-prefixed pickles on its stdin and on a private copy of its
stdout (the backend's own prints go to its stderr, kept in a file). When the worker dies or does not answer
within the timeout, the call is reported as crashed, with the end of the worker's stderr, and a fresh
worker serves the next call.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from .adapters import BackendLoadError
from .outcome import Outcome
from .worker_protocol import receive, send


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
    """The backend :func:`~kvcache_op.validation.backends.make_backend` builds from (``spec``, ``options``), in a
    worker process; ``timeout`` seconds per call. Raises :class:`BackendLoadError` when the worker cannot
    build it."""

    def __init__(self, spec: str, options: dict, timeout: float = 300.0):
        self.spec, self.options, self.timeout = spec, dict(options), timeout
        self._process = None
        self.ops, self.name = self._start()

    def _start(self):
        self._stderr = tempfile.TemporaryFile()
        # A session of its own: what the backend forks is killed with the worker when a call fails.
        self._process = subprocess.Popen([sys.executable, "-m", "kvcache_op.validation.isolated_worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                         start_new_session=True)
        # The worker sees what this process sees: its sys.path (the current directory, PYTHONPATH, tests' helpers).
        try:
            send(self._process.stdin, (list(sys.path), os.getcwd(), self.spec, self.options))
            ready = receive(self._process.stdout.fileno(), time.monotonic() + self.timeout, self._alive)
        except (EOFError, BrokenPipeError):
            raise BackendLoadError(f"--backend {self.spec}: the worker process {self._exit_text()}") from None
        except TimeoutError:
            self._exit_text()  # kills the worker's group
            raise BackendLoadError(f"--backend {self.spec}: the backend did not load within {self.timeout:g} s "
                                   "(--timeout; its worker process was killed)") from None
        except BaseException:  # Ctrl-C: the worker, in a session of its own, did not get it
            self._stop()
            raise
        if "error" in ready:
            self.close()
            raise BackendLoadError(ready["error"])
        return frozenset(ready["ops"]), ready["name"]

    def _alive(self) -> bool:
        """Whether the worker still runs, without reaping it: its pid, and so its process group's id, stays its own
        until :meth:`_exit_text` has killed the group."""
        try:
            return os.waitid(os.P_PID, self._process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # already reaped
            return False

    def _kill(self) -> None:
        """Kills the worker and whatever it started (its session's process group)."""
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self._process.kill()

    def _exit_text(self) -> str:
        """How the worker ended (waited for), with the telling part of its stderr; what it forked is killed first
        (children left holding the answer pipe), while the unreaped worker still holds the group's id."""
        self._kill()
        code = self._process.wait()
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace")
        self._stderr.close()
        return _describe_exit(code) + (": " + " | ".join(_crash_lines(text)) if text.strip() else "")

    def run(self, op: str, inputs: dict, attributes: dict, model=None) -> Outcome:
        """Runs the call in the worker; ``inputs``' in-place arrays receive what the backend left in them. A
        crash or timeout is an Outcome with ``crashed`` set (and ``after`` empty: the memory is gone)."""
        if self._process is None or self._process.poll() is not None:
            try:
                self._start()
            except BackendLoadError as error:  # it loaded before: say so for this call, and try again next time
                return self._crashed(f"the backend's worker could not be restarted: {error}")
        request = (op, inputs, attributes, None if model is None else model.SerializeToString())
        try:
            send(self._process.stdin, request)
            answer = receive(self._process.stdout.fileno(), time.monotonic() + self.timeout, self._alive)
        except (EOFError, BrokenPipeError):
            return self._crashed(f"the backend crashed: its process {self._exit_text()}")
        except TimeoutError:
            self._exit_text()  # kills the worker's group
            return self._crashed(f"the backend did not return within {self.timeout:g} s (its process was killed)",
                                 timed_out=True)
        except BaseException:  # Ctrl-C: the worker, in a session of its own, did not get it
            self._stop()
            raise
        for name, array in answer.after.items():
            # What the backend left, in the caller's arrays; one it reshaped or retyped is reported as it is.
            if inputs.get(name) is not None and np.shape(array) == inputs[name].shape and \
                    np.asarray(array).dtype == inputs[name].dtype:
                inputs[name][...] = array
                answer.after[name] = inputs[name]
        return answer

    def _crashed(self, message: str, timed_out: bool = False) -> Outcome:
        self._process = None
        return Outcome(None, {}, error=message, crashed=True, timed_out=timed_out)

    def _stop(self) -> None:
        """Kills the worker's process group at once and reaps the worker."""
        self._kill()
        self._process.wait()
        self._stderr.close()
        self._process = None

    def close(self):
        """Stops the worker: it ends when its stdin closes (within 10 s, else it is killed); then whatever the
        backend forked is killed with its process group."""
        if self._process is None:
            return
        try:
            self._process.stdin.close()
            deadline = time.monotonic() + 10
            while self._alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            self._stop()
