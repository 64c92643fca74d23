"""``kvcache-op serve MODEL``: an OpenAI-compatible server for an exported file or a checkpoint folder (exported once
into a cache folder and reused while the checkpoint is unchanged), with the checkpoint's tokenizer and chat
template."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import onnx

from .export_command import SOURCE_KEY, tokenizer_folder
from .export_process import export_in_child
from .listening import is_loopback, listening_socket, url_of, usable_cores

API_KEY_VARIABLE = "KVCACHE_OP_API_KEY"  # the API key when --api-key is not given


def default_cache_dir() -> pathlib.Path:
    """Where checkpoint folders are exported to: ``$KVCACHE_OP_CACHE`` or ``~/.cache/kvcache-op``."""
    return pathlib.Path(os.environ.get("KVCACHE_OP_CACHE") or pathlib.Path.home() / ".cache" / "kvcache-op")


def _checkpoint_key(folder: pathlib.Path, settings: dict) -> str:
    """Names a checkpoint's export: its path, the size and modification time of every file in it (a changed weight
    file means a new export), the export settings and the export format."""
    from .serving.model_info import FORMAT_VERSION

    # The export format too: an export of an older kvcache-op that this one cannot serve is made again, not reused.
    entries = [str(folder.resolve()), json.dumps(settings, sort_keys=True), f"format {FORMAT_VERSION}"]
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        entries.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:20]


def resolve_model(model, *, tokenizer=None, cache_dir=None, settings=None, progress=print) -> tuple:
    """(ONNX file, tokenizer folder) for ``model``: an exported file (its tokenizer from ``tokenizer``, else the
    ``OUT.tokenizer`` folder beside it, else the checkpoint its metadata names) or a checkpoint folder (exported with
    ``settings`` into ``cache_dir`` unless already there, in a process of its own: what exporting leaves in memory
    is not kept by a server for its whole life). ``FileNotFoundError``/``ValueError`` naming what is missing."""
    model = pathlib.Path(model)
    if model.is_dir():
        from .serving.tokenizer import check_tokenizer_folder, load_tokenizer

        check_tokenizer_folder(tokenizer or model)  # before anything: a folder without one is refused at once
        settings = dict(settings or {})
        out = pathlib.Path(cache_dir or default_cache_dir()) / _checkpoint_key(model, settings) / "model.onnx"
        complete = out.with_name("complete")  # written last: an interrupted export is redone, not reused
        if complete.is_file():
            progress(f"using the export of {model} cached at {out}")
            exported_model(out)  # a cache entry damaged since is refused here, in one line
        else:
            from .arguments import writable_folder_problem

            load_tokenizer(tokenizer or model)  # loaded once before the export: a damaged one is not found after it
            problem = writable_folder_problem(out.parent)  # tried before the export, not found after it
            if problem:
                raise ValueError(f"the cache folder {out.parent.parent} (--cache-dir, $KVCACHE_OP_CACHE) cannot take "
                                 f"the export: {problem}")
            made = not out.parent.exists()
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                export_in_child(model, out, settings=settings, progress=progress)
            except BaseException as error:
                if made:  # nothing of a failed or interrupted export is left to look like a cache entry
                    shutil.rmtree(out.parent, ignore_errors=True)
                if isinstance(error, RuntimeError):  # the child failed in a way it did not name: one line all the same
                    raise ValueError(str(error)) from error
                raise
            complete.write_text(str(model.resolve()))
        return out, pathlib.Path(tokenizer) if tokenizer else model
    if not model.is_file():
        raise FileNotFoundError(f"no exported model or checkpoint folder at {model}")
    proto = exported_model(model)  # read once, here: a file that is no export is refused before anything starts
    if tokenizer:
        return model, pathlib.Path(tokenizer)
    beside = tokenizer_folder(model)
    if beside.is_dir():
        return model, beside
    props = {p.key: p.value for p in proto.metadata_props}
    source = props.get(SOURCE_KEY)
    if source and pathlib.Path(source).is_dir():
        return model, pathlib.Path(source)
    raise ValueError(f"no tokenizer for {model}: none beside it ({beside}) and no checkpoint folder in its metadata; "
                     "pass --tokenizer DIR")


def served_name(args) -> str:
    """The model id clients send: ``--model-name``, else the file's name without ``.onnx`` or the folder's name
    (of its full path, links not followed: ``serve .`` is named after the folder it means, a link after itself)."""
    return args.model_name or pathlib.Path(os.path.abspath(args.model)).name.removesuffix(".onnx")


def exported_model(path) -> onnx.ModelProto:
    """The exported file at ``path`` (its weights not read), checked to be a decoder this package exported
    (:meth:`~kvcache_op.serving.model_info.ModelInfo.of_model`); ``ValueError`` where it is no ONNX file or no such
    decoder."""
    from google.protobuf.message import DecodeError

    from .ort_ops.graph_rules import load_model
    from .serving.model_info import ModelInfo

    try:
        proto = load_model(path)
    except DecodeError:
        raise ValueError(f"{path} is not a readable ONNX file (truncated, or not ONNX)") from None
    try:
        ModelInfo.of_model(proto)
        return proto
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def api_key_of(given) -> str:
    """The API key the server requires: ``--api-key``, else ``$KVCACHE_OP_API_KEY``, else None (no key).
    ``ValueError`` for an empty ``--api-key`` (a script's unset variable, say), which would otherwise serve with no key
    or with another one."""
    if given is not None and not given.strip():
        raise ValueError("--api-key is empty: give the key, or leave the flag out to serve without one "
                         f"(or with ${API_KEY_VARIABLE})")
    return given or os.environ.get(API_KEY_VARIABLE) or None


def serve(args) -> int:
    """Runs the server until interrupted (or ``--stop-after`` seconds); prints ``listening on URL`` once ready.
    With ``--replicas N`` the app runs as N Ray Serve replicas, each with its own engine."""
    from .serving.server import ServerLimits

    if not is_loopback(args.host) and not args.allow_remote:
        raise ValueError(f"--host {args.host} is not loopback: pass --allow-remote to listen on other interfaces "
                         "(and set an API key)")
    cores = usable_cores()
    if args.threads > 4 * cores:  # ONNX Runtime starts them all; tens of thousands stall the start for minutes
        raise ValueError(f"--threads {args.threads}: more than four times this machine's {cores} cores")
    if args.replicas and args.replicas > cores:
        raise ValueError(f"--replicas {args.replicas}: more than this machine's {cores} cores (each replica runs its "
                         "own engine and holds its own copy of the model)")
    api_key = api_key_of(args.api_key)
    export_flags = {"--page-size": args.page_size, "--quant-bit": args.quant_bit, "--dtype": args.dtype,
                    "--cache-dir": args.cache_dir}
    given = [flag for flag, value in export_flags.items() if value is not None]
    if given and pathlib.Path(args.model).is_file():  # (a path that is neither is refused as such below)
        raise ValueError(f"{', '.join(given)} set how a checkpoint folder is exported; {args.model} is not one (an "
                         "exported file keeps the settings it was exported with)")
    settings = {"page_size": 16 if args.page_size is None else args.page_size,
                "quant_bit": args.quant_bit or 0, "dtype": args.dtype}
    path, tokenizer_dir = resolve_model(args.model, tokenizer=args.tokenizer, cache_dir=args.cache_dir,
                                        settings=settings)
    name = served_name(args)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue)
    engine_options = engine_options_of(args)
    began = time.perf_counter()
    if args.replicas:
        from .ray_command import serve_on_ray

        stop_signal = serve_on_ray(args, path, tokenizer_dir, name, api_key, limits, engine_options)
    else:
        stop_signal = _serve_here(args, path, tokenizer_dir, name, api_key, limits, engine_options)
    print(f"stopped {f'by {stop_signal} ' if stop_signal else ''}after {time.perf_counter() - began:.1f} s", flush=True)
    return 0


def engine_options_of(args) -> dict:
    """The :class:`~kvcache_op.serving.Engine` keywords ``kvcache-op serve``'s flags give (None: the engine's default)."""
    return dict(num_pages=args.num_pages, max_batch_tokens=args.max_batch_tokens, max_running=args.max_running,
                intra_op_num_threads=args.threads, decode_steps=args.decode_steps)


def _draining_server():
    """:class:`~kvcache_op.serving.server.DrainingServer` (the engine's requests end first when it shuts down: a
    signal, or ``--stop-after``), with the command's signal handling. ``stop_signal``: the name of the signal that
    stopped it, if one did."""
    from .serving.server import DrainingServer

    class CommandServer(DrainingServer):
        stop_signal = None

        def handle_exit(self, sig, frame):
            # uvicorn's own handler has the signal raised again once the server is down, which turns a Ctrl-C into
            # a KeyboardInterrupt traceback and a TERM into death by that signal; here the drained shutdown is the
            # command's normal end, and the signal is named in its last line.
            self.stop_signal = signal.Signals(sig).name
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for the replies
            else:
                self.should_exit = True

    return CommandServer


def _serve_here(args, path, tokenizer_dir, name, api_key, limits, engine_options) -> str:
    """One engine in this process, under uvicorn, until a signal or ``--stop-after``: the signal's name, or None."""
    import uvicorn

    from .serving import Engine
    from .serving.server import create_app
    from .serving.tokenizer import PlainText, load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    engine = Engine(path, tokenizer=PlainText(tokenizer), **engine_options)
    app = create_app(engine, tokenizer, model_name=name, api_key=api_key, limits=limits)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    server = _draining_server()(config, engine)
    if args.stop_after:  # a bounded lifetime (tests, load tests): the server stops by itself
        timer = threading.Timer(args.stop_after, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()
    print(f"serving {name!r} ({path}, {engine.info.num_layers} layers, {args.num_pages} pages) "
          f"{'with' if api_key else 'without'} an API key", flush=True)
    _announce_when_started(server, f"listening on {url_of(host, port)}")
    server.run(sockets=[sock])
    return server.stop_signal


def _announce_when_started(server, line: str) -> None:
    """Prints ``line`` once uvicorn accepts connections (what a caller waits for)."""
    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            print(line, flush=True)
    threading.Thread(target=watch, daemon=True).start()


class ServerProcess:
    """``kvcache-op serve MODEL ARGS...`` in a subprocess on a free loopback port, bounded by ``--stop-after
    lifetime`` seconds: :meth:`start` waits until it listens (``RuntimeError`` with its output if it exits or takes
    longer than ``start_timeout``); ``url`` is its base URL; :meth:`stop` ends it. A context manager. ``env``: variables
    set for it on top of this process's."""

    def __init__(self, model, *args, lifetime: float = 900, start_timeout: float = 180, env: dict = None):
        self.command = [sys.executable, "-m", "kvcache_op", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
                        "--stop-after", str(lifetime), *map(str, args)]
        self.env = {**os.environ, **(env or {})}
        self.start_timeout, self.url, self.process, self._lines, self._reader = start_timeout, None, None, [], None

    @property
    def output(self) -> str:
        """What the server printed so far."""
        return "".join(self._lines)

    def start(self) -> "ServerProcess":
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=self.env)
        listening = threading.Event()

        def read():
            for line in self.process.stdout:
                self._lines.append(line)
                if "listening on http://" in line:
                    listening.set()
        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout
        while not listening.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start (exit {self.process.returncode}):\n{self.output[-3000:]}")
        self.url = re.search(r"listening on (http://\S+)", self.output).group(1)
        return self

    def wait(self, timeout: float) -> int:
        """Waits for the server to exit by itself, and for its last output to be read; its exit status
        (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        code = self.process.wait(timeout)
        self._reader.join(timeout)
        return code

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
