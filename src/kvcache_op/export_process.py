"""A checkpoint's export run in a process of its own, for a caller that lives on after it (``kvcache-op serve``).

Exporting leaves memory behind in the process that ran it, for as long as it lives: the libraries it goes through
keep what they last worked on (onnxscript's module-level rewrite rules keep the last graph they matched, its weights
included; torch.export keeps traced graphs), about one and a half times the checkpoint's weights when measured. A
server that exported on first use held that for its whole life. In a child process it is all returned when the
child ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback

from .extras import missing_optional_module

# Errors the export raises for what the caller can fix (a missing folder, a refused setting), most specific first:
# raised again in the parent as the first of these the error is an instance of, with its text; any other is raised
# as RuntimeError naming its type (its traceback printed by the child).
_EXPECTED = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError, OSError,
             ValueError, TypeError, NotImplementedError)
_BY_NAME = {error.__name__: error for error in _EXPECTED}
_ENDING_SECONDS = 30  # what a child that has answered may take to end before it is killed


def _expected_name(error: BaseException) -> str | None:
    """The name of the first of :data:`_EXPECTED` that ``error`` is an instance of, else None."""
    return next((kind.__name__ for kind in _EXPECTED if isinstance(error, kind)), None)


def _end_with_parent(parent: int) -> None:
    """Ends this process once its parent is gone (killed, say): an orphan would go on writing the export where a
    restarted server exports again."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


class _ParentGone(BaseException):
    """The parent stopped listening (interrupted): nothing is left to tell it. A BaseException, so that the export's
    own cleanup (its partial file) runs as it unwinds and no handler of errors takes it for one."""


def _send(sender, message) -> None:
    try:
        sender.send(message)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        raise _ParentGone from None


def _export_child(checkpoint: str, out: str, settings: dict, sender, parent: int) -> None:
    """The child's work: exports, sending ``("progress", line)`` for each line, then ``("done", result)`` or
    ``("error", (type name, text))``, or ``("error", ("ModuleNotFoundError", text, module))`` for a missing optional
    module. Ctrl-C is the parent's to handle (it ends the child)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, args=(parent,), name="kvcache-op-export-watch", daemon=True).start()
    from .export_command import export_checkpoint

    try:
        try:
            result = export_checkpoint(checkpoint, out, progress=lambda line: _send(sender, ("progress", line)),
                                       **settings)
            _send(sender, ("done", result))
        except Exception as error:  # noqa: BLE001 - every failure reaches the parent, which raises it
            missing = missing_optional_module(error) if isinstance(error, ImportError) else None
            if missing is not None:  # the parent names the extra that brings it
                _send(sender, ("error", ("ModuleNotFoundError", str(error), missing)))
                return
            name = _expected_name(error)
            if name is None:
                traceback.print_exc()
            _send(sender, ("error", (name or type(error).__name__, str(error))))
    except _ParentGone:
        pass  # the parent was interrupted and is ending this export: it says so itself
    finally:
        sender.close()


def export_in_child(checkpoint, out, *, settings: dict | None = None, progress=print) -> dict:
    """:func:`~kvcache_op.export_command.export_checkpoint` (``settings`` its keywords) run in a fresh process, each
    of its progress lines passed to ``progress`` here as it comes; returns what it returns. Its errors are raised
    here: those a caller can fix as the same type (or the nearest of :data:`_EXPECTED` above it) and text, any other
    as ``RuntimeError``; a child that ends without an answer (killed, out of memory) is a ``RuntimeError`` naming its
    exit code. Interrupted (Ctrl-C), the child is ended. The child is started by ``multiprocessing``'s spawn, which
    imports the caller's main script again: a script calling this needs an ``if __name__ == "__main__":`` guard."""
    context = multiprocessing.get_context("spawn")  # not fork: the caller may hold threads and an ONNX Runtime session
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_export_child,
                            args=(str(checkpoint), str(out), dict(settings or {}), sender, os.getpid()),
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
        # With an answer the child is ending; without one it has ended (EOF) or this caller was interrupted.
        child.join(_ENDING_SECONDS if answer is not None else 5)
        if child.is_alive():
            child.kill()
            child.join()
    if answer is None:
        raise RuntimeError(f"the export of {checkpoint} ended without an answer (exit code {child.exitcode})")
    kind, payload = answer
    if kind == "done":
        return payload
    raise child_error(checkpoint, *payload)


def child_error(checkpoint, name: str, text: str, module: str | None = None) -> Exception:
    """The exception to raise for the child's error of type ``name`` with ``text``: that type where it is one of
    :data:`_EXPECTED` (a caller can fix its cause), a ``ModuleNotFoundError`` naming ``module`` where the child
    missed that optional module, else a ``RuntimeError`` naming the type."""
    if name == "ModuleNotFoundError" and module is not None:
        return ModuleNotFoundError(text, name=module)
    if name in _BY_NAME:
        return _BY_NAME[name](text)
    return RuntimeError(f"the export of {checkpoint} failed: {name}: {text}")
