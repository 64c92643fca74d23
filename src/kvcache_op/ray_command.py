"""``kvcache-op serve --replicas N``: the server as N Ray Serve replicas on a Ray instance of its own, stopped as a
single server is (its requests ended as whole "abort" replies first, exit status 0, the signal named)."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import time

from .listening import free_port, is_loopback, listening_socket, url_of, usable_cores

_POLL_SECONDS = 0.05
_DRAIN_SECONDS = 12.0  # what the replicas may take to close their engines (each waits up to 10 s for its thread)
_REPLY_SECONDS = 1.0  # then what their last replies may take to pass Ray Serve's proxy


class _Stopped(BaseException):
    """A stop signal that came while Ray Serve was starting: it ends the start, as Ctrl-C would."""


def serve_on_ray(args, path, tokenizer_dir, name, api_key, limits, engine_options) -> str | None:
    """``args.replicas`` replicas on a local Ray instance, behind Ray Serve's proxy on ``host:port``, until a signal
    or ``--stop-after``: the signal's name, or None. A stop ends the replicas' requests first, as a single server's
    does (finish_reason "abort", each reply whole), then shuts Serve down; one while Ray Serve starts ends the
    start."""
    ray = _import_ray()  # a missing Ray is said before anything else
    if args.port:  # refused now, in one line, not by Ray Serve's proxy once Ray has started
        listening_socket(args.host, args.port).close()
    port = args.port or free_port(args.host)  # Ray Serve's proxy needs the number up front
    if not engine_options["intra_op_num_threads"]:  # replicas share the machine's cores
        engine_options["intra_op_num_threads"] = max(1, usable_cores() // args.replicas)
    # --log-level for Ray Serve's own lines too: this process's, and the controller's, proxy's and replicas' (their
    # access log is INFO, off at the default "warning" as uvicorn's is in one process).
    logging.getLogger("ray.serve").setLevel(args.log_level.upper())
    logs = {"log_level": args.log_level.upper()}
    drain_folder = pathlib.Path(tempfile.mkdtemp(prefix="kvcache-op-drain-"))
    stop = _StopSignals()  # before Ray's: its SIGTERM handler exits at once (status 15), skipping the drain
    try:
        _start_local_ray(ray)
        stop.install()
        from ray import serve

        from .serving.ray import deployment

        _start_serve(serve, args.host, port, logs)
        app = deployment(path, tokenizer_dir, replicas=args.replicas, model_name=name, api_key=api_key,
                         limits=limits, drain_file=drain_folder / "drain", **engine_options)
        print(f"serving {name!r} ({path}) as {args.replicas} Ray Serve replicas, {args.num_pages} pages each, "
              f"{'with' if api_key else 'without'} an API key", flush=True)
        try:
            serve.run(app, route_prefix="/", name="kvcache-op", logging_config=logs)
        except RuntimeError as error:  # a replica that could not start: its own error, in one line
            raise ValueError(_replica_error(serve) or str(error).strip().splitlines()[0]) from None
        stop.serving = True
        print(f"listening on {url_of(args.host, port)}", flush=True)
        deadline = time.monotonic() + args.stop_after if args.stop_after else None
        while not stop.stopping and (deadline is None or time.monotonic() < deadline):
            time.sleep(_POLL_SECONDS)
        stop.stopping = True
        _drain_replicas(drain_folder / "drain", args.replicas, stop)
        serve.shutdown()
    except _Stopped:
        pass  # stopped while starting: nothing was served
    finally:
        stop.restore()
        ray.shutdown()
        shutil.rmtree(drain_folder, ignore_errors=True)
    return stop.name


def _replica_error(serve) -> str | None:
    """What stopped the replicas from starting, as the engine said it (``a replica could not start: ...``, the last
    ``...Error: message`` line of the deployment's status), or None where Ray Serve's status says none."""
    import re

    try:
        application = serve.status().applications.get("kvcache-op")
        messages = [d.message for d in application.deployments.values() if d.message] if application else []
    except Exception:  # noqa: BLE001 - no status to be had: the caller says what serve.run said
        return None
    for message in messages:
        errors = re.findall(r"^\s*(?:\w+\.)*(\w*Error): (.+)$", message, re.M)
        if errors:
            return f"a replica could not start: {errors[-1][1]}"
    return None


def _drain_replicas(drain_file: pathlib.Path, replicas: int, stop) -> None:
    """Has every replica end its requests (:func:`~kvcache_op.serving.ray.deployment`'s ``drain_file``), waiting
    until all have, for at most :data:`_DRAIN_SECONDS`, or until a second signal."""
    from .serving.ray import drained_replicas

    drain_file.touch()
    until = time.monotonic() + _DRAIN_SECONDS
    while drained_replicas(drain_file) < replicas and time.monotonic() < until and not stop.forced:
        time.sleep(_POLL_SECONDS)
    end = time.monotonic() + _REPLY_SECONDS
    while time.monotonic() < end and not stop.forced:
        time.sleep(_POLL_SECONDS)


class _StopSignals:
    """SIGINT and SIGTERM while installed. The first asks for a stop (``stopping``; ``name``, the signal's name), and
    while Ray Serve is still starting (``serving`` false) ends the start (:class:`_Stopped`); once stopping, another
    stops waiting for the replies (``forced``). :meth:`restore` puts the handlers before back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.name, self.stopping, self.serving, self.forced = None, False, False, False
        self._before = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        self.install()

    def install(self) -> None:
        """(Re)installs the handlers: ``ray.init`` installs its own for SIGTERM."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, sig, frame) -> None:
        if self.stopping:
            self.forced = True
            return
        self.name, self.stopping = signal.Signals(sig).name, True
        if not self.serving:
            raise _Stopped

    def restore(self) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


def _start_serve(serve, host: str, port: int, logs: dict) -> None:
    """``serve.start`` with its proxy on ``host:port``; ``OSError`` in one line where the proxy cannot bind it (the
    port was free when checked: another process took it since), not Ray's traceback of its proxy actor."""
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=logs)
    except Exception as error:  # noqa: BLE001 - Ray wraps the proxy's error in its own task error
        if "Failed to bind to address" not in str(error):
            raise
        raise OSError(f"Ray Serve's proxy could not listen on {url_of(host, port)}: the port was free when checked "
                      f"and another process took it since; start again (or pass another --port)") from None


def _import_ray():
    """The ``ray`` module with Ray Serve, imported so that a local instance keeps its servers on loopback (below);
    ``ValueError`` saying why when it does not import."""
    if "ray" not in sys.modules:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    try:
        import ray
        import ray.serve  # noqa: F401
    except ImportError as error:  # ray missing, or present without what Ray Serve needs: say which
        raise ValueError(f"--replicas needs Ray Serve, which does not import ({error}): pip install "
                         "'kvcache-op[ray]'") from None
    return ray


def _start_local_ray(ray) -> None:
    """A new Ray instance on this machine alone, its own servers (GCS, raylet, agents, actors) on loopback. Never
    joins a running cluster (``RAY_ADDRESS`` is ignored): ``serve.shutdown`` at the end would tear down that
    cluster's Serve applications.

    On Linux Ray replaces a loopback node address with the machine's outward one (``ray.init(_node_ip_address=
    "127.0.0.1")`` included) and then binds its servers to every interface; with
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ``ray`` is imported; named for the platforms where it is the
    default) its node address stays loopback, and the servers bind there. Ray Serve's replicas still open their
    inter-deployment gRPC port on every interface (Ray binds it to ``[::]`` itself; Ray's token authentication,
    on in the Ray the tests run, guards it)."""
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    node = ray.util.get_node_ip_address()
    if not is_loopback(node):
        ray.shutdown()
        raise ValueError(f"the local Ray instance took the node address {node}, not loopback, and would listen "
                           "on it: start the server in a fresh process (ray was imported before "
                           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 could be set)")
