"""A checkpoint's export run in a process of its own, for a caller that lives on after it (``kvcache-op serve``).

Exporting leaves memory behind in the process that ran it, for as long as it lives: the libraries it goes through
keep what they last worked on (onnxscript's module-level rewrite rules keep the last graph they matched, its weights
included; torch.export keeps traced graphs), about one and a half times the checkpoint's weights when measured. A
server that exported on first use held that for its whole life. In a child process it is all returned when the
child ends.
"""

from __future__ import annotations

import multiprocessing
import traceback

# Errors the export raises for what the caller can fix (a missing folder, a refused setting), raised again in the
# parent as the same type and text; any other is raised as RuntimeError naming its type (its traceback printed by
# the child).
_EXPECTED = {error.__name__: error for error in (FileNotFoundError, NotADirectoryError, PermissionError, ValueError,
                                                 TypeError, NotImplementedError, OSError)}


def _export_child(checkpoint: str, out: str, settings: dict, sender) -> None:
    """The child's work: exports, sending ``("progress", line)`` for each line, then ``("done", result)`` or
    ``("error", (type name, text))``."""
    from .export_command import export_checkpoint

    try:
        result = export_checkpoint(checkpoint, out, progress=lambda line: sender.send(("progress", line)),
                                   **settings)
        sender.send(("done", result))
    except BaseException as error:  # noqa: BLE001 - every failure reaches the parent, which raises it
        if type(error).__name__ not in _EXPECTED:
            traceback.print_exc()
        sender.send(("error", (type(error).__name__, str(error))))
    finally:
        sender.close()


def export_in_child(checkpoint, out, *, settings: dict | None = None, progress=print) -> dict:
    """:func:`~kvcache_op.export_command.export_checkpoint` (``settings`` its keywords) run in a fresh process, each
    of its progress lines passed to ``progress`` here as it comes; returns what it returns. Its errors are raised
    here: those a caller can fix as the same type and text, any other as ``RuntimeError``; a child that ends without
    an answer (killed, out of memory) is a ``RuntimeError`` naming its exit code."""
    context = multiprocessing.get_context("spawn")  # not fork: the caller may hold threads and an ONNX Runtime session
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_export_child, args=(str(checkpoint), str(out), dict(settings or {}), sender),
                            name="kvcache-op-export", daemon=True)
    child.start()
    sender.close()  # the child holds the only sender: its end is this end's EOF
    answer = None
    try:
        while answer is None:
            try:
                kind, payload = receiver.recv()
            except EOFError:
                break
            if kind == "progress":
                progress(payload)
            else:
                answer = (kind, payload)
    finally:
        receiver.close()
        child.join(None if answer is not None else 5)  # without an answer: ended (EOF) or the caller was interrupted
        if child.is_alive():
            child.kill()
            child.join()
    if answer is None:
        raise RuntimeError(f"the export of {checkpoint} ended without an answer (exit code {child.exitcode})")
    kind, payload = answer
    if kind == "done":
        return payload
    raise child_error(checkpoint, *payload)


def child_error(checkpoint, name: str, text: str) -> Exception:
    """The exception to raise for the child's error of type ``name`` with ``text``: the same type where the caller
    can fix its cause, else a ``RuntimeError`` naming the type."""
    if name in _EXPECTED:
        return _EXPECTED[name](text)
    return RuntimeError(f"the export of {checkpoint} failed: {name}: {text}")
