"""The backend worker (``python -m kvcache_op.validation.isolated_worker``): builds the backend a
:class:`~kvcache_op.validation.isolated.IsolatedBackend` names, then answers its calls one at a time."""

import os
import sys

from .adapters import BackendLoadError, error_text
from .backends import make_backend
from .outcome import copies, read_only_changes
from .worker_protocol import receive, send


def main() -> int:
    """The worker's loop: builds the backend, then answers one request at a time until stdin closes."""
    import onnx

    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the backend's prints must not reach the answer pipe
    import faulthandler

    faulthandler.enable()  # a crash leaves a Python traceback in stderr, which the parent reports
    requests = sys.stdin.buffer.fileno()
    path, cwd, spec, options = receive(requests)
    sys.path[:] = path
    os.chdir(cwd)
    try:
        backend = make_backend(spec, options)
    except BackendLoadError as error:
        send(answers, {"error": str(error)})
        return 1
    except Exception as error:  # noqa: BLE001
        send(answers, {"error": f"--backend {spec}: {error_text(error)}"})
        return 1
    send(answers, {"ops": sorted(backend.ops), "name": backend.name})
    while True:
        try:
            op, inputs, attributes, model = receive(requests)
        except EOFError:
            return 0
        model = None if model is None else onnx.load_from_string(model)
        given = copies(inputs)
        answer = backend.run(op, given, attributes, model)
        answer.changed_inputs = tuple(answer.changed_inputs) + read_only_changes(op, inputs, given)
        send(answers, answer)


if __name__ == "__main__":
    sys.exit(main())
