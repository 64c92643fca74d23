"""``kvcache-op serve MODEL``: an OpenAI-compatible server for an exported file or a checkpoint folder (exported once
into a cache folder and reused while the checkpoint is unchanged), with the checkpoint's tokenizer and chat
template."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import socket
import threading
import time

import onnx

from .export_command import SOURCE_KEY, export_checkpoint, tokenizer_folder

API_KEY_VARIABLE = "KVCACHE_OP_API_KEY"  # the API key when --api-key is not given
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def default_cache_dir() -> pathlib.Path:
    """Where checkpoint folders are exported to: ``$KVCACHE_OP_CACHE`` or ``~/.cache/kvcache-op``."""
    return pathlib.Path(os.environ.get("KVCACHE_OP_CACHE") or pathlib.Path.home() / ".cache" / "kvcache-op")


def _checkpoint_key(folder: pathlib.Path, settings: dict) -> str:
    """Names a checkpoint's export: its path, the size and modification time of every file in it (a changed weight
    file means a new export) and the export settings."""
    entries = [str(folder.resolve()), json.dumps(settings, sort_keys=True)]
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        stat = path.stat()
        entries.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:20]


def resolve_model(model, *, tokenizer=None, cache_dir=None, settings=None, progress=print) -> tuple:
    """(ONNX file, tokenizer folder) for ``model``: an exported file (its tokenizer from ``tokenizer``, else the
    ``OUT.tokenizer`` folder beside it, else the checkpoint its metadata names) or a checkpoint folder (exported with
    ``settings`` into ``cache_dir`` unless already there). ``FileNotFoundError``/``ValueError`` naming what is
    missing."""
    model = pathlib.Path(model)
    if model.is_dir():
        settings = dict(settings or {})
        out = pathlib.Path(cache_dir or default_cache_dir()) / _checkpoint_key(model, settings) / "model.onnx"
        complete = out.with_name("complete")  # written last: an interrupted export is redone, not reused
        if complete.is_file():
            progress(f"using the export of {model} cached at {out}")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            export_checkpoint(model, out, progress=progress, **settings)
            complete.write_text(str(model.resolve()))
        return out, pathlib.Path(tokenizer) if tokenizer else model
    if not model.is_file():
        raise FileNotFoundError(f"no exported model or checkpoint folder at {model}")
    if tokenizer:
        return model, pathlib.Path(tokenizer)
    beside = tokenizer_folder(model)
    if beside.is_dir():
        return model, beside
    props = {p.key: p.value for p in onnx.load(str(model), load_external_data=False).metadata_props}
    source = props.get(SOURCE_KEY)
    if source and pathlib.Path(source).is_dir():
        return model, pathlib.Path(source)
    raise ValueError(f"no tokenizer for {model}: none beside it ({beside}) and no checkpoint folder in its metadata; "
                     "pass --tokenizer DIR")


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one, read back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def serve(args) -> int:
    """Runs the server until interrupted (or ``--stop-after`` seconds); prints ``listening on URL`` once ready."""
    import uvicorn

    from .serving import Engine
    from .serving.server import ServerLimits, create_app
    from .serving.tokenizer import load_tokenizer

    if args.host not in LOOPBACK and not args.allow_remote:
        raise ValueError(f"--host {args.host} is not loopback: pass --allow-remote to listen on other interfaces "
                         "(and set an API key)")
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    settings = {"page_size": args.page_size, "quant_bit": args.quant_bit, "dtype": args.dtype}
    path, tokenizer_dir = resolve_model(args.model, tokenizer=args.tokenizer, cache_dir=args.cache_dir,
                                        settings=settings)
    tokenizer = load_tokenizer(tokenizer_dir)
    engine = Engine(path, num_pages=args.num_pages, max_batch_tokens=args.max_batch_tokens,
                    max_running=args.max_running, intra_op_num_threads=args.threads, tokenizer=tokenizer)
    name = args.model_name or pathlib.Path(args.model).name.removesuffix(".onnx")
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens_limit=args.max_tokens_limit, max_queue=args.max_queue)
    app = create_app(engine, tokenizer, model_name=name, api_key=api_key, limits=limits)
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    if args.stop_after:  # a bounded lifetime (tests, load tests): the server stops by itself
        timer = threading.Timer(args.stop_after, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name!r} ({path}, {engine.info.num_layers} layers, {args.num_pages} pages) "
          f"{'with' if api_key else 'without'} an API key", flush=True)
    began = time.perf_counter()
    _announce_when_started(server, f"listening on http://{shown}:{port}")
    server.run(sockets=[sock])
    print(f"stopped after {time.perf_counter() - began:.1f} s", flush=True)
    return 0


def _announce_when_started(server, line: str) -> None:
    """Prints ``line`` once uvicorn accepts connections (what a caller waits for)."""
    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            print(line, flush=True)
    threading.Thread(target=watch, daemon=True).start()
