"""Scale-out on Ray Serve (the ``ray`` extra): the same OpenAI-compatible app, N replicas each with its own engine
(and its own cache), behind Ray Serve's HTTP proxy and router. Each replica builds its engine and app when it
starts (Ray Serve's late-bound ingress), so nothing heavy is pickled.

    app = deployment("model.onnx", "model.tokenizer", replicas=2, num_pages=256, model_name="tiny")
    serve.run(app, route_prefix="/")
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import inspect
import logging
import os
import pathlib
import threading
import time

from ray import serve

from .engine import DEFAULT_RUNNING
from .server import ServerLimits

_DRAIN_POLL_SECONDS = 0.05
# Requests a replica takes beyond its running and waiting ones: those that hold no slot (/health, /metrics, a
# reply still streaming to a slow client) and those past the limit, which reach the engine to be refused (503).
_HEADROOM = 64
_DRAIN_CLOSE_SECONDS = 10.0  # what the engine's close waits for its thread, as a single server's shutdown does
#: How often each replica leaves its /metrics series for the others to answer, and after how long without news a
#: replica's are left out (it is gone: Ray Serve starts another, with an id of its own).
_METRICS_PUSH_SECONDS = 1.0
_METRICS_STALE_SECONDS = 30.0
_METRICS_CALL_SECONDS = 5.0
_METRICS_GATHER_SECONDS = 2.0  # a scrape waits this long for the hub at most, then answers 503
log = logging.getLogger("kvcache_op.server")


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class MetricsHub:
    """Where the replicas leave their ``/metrics`` series (each every :data:`_METRICS_PUSH_SECONDS`), so that any
    replica's ``/metrics`` answers them all from here: Ray Serve's router sends a scrape to one replica of its choosing,
    and series answered from one place only move forward from one scrape to the next."""

    def __init__(self):
        self.texts = {}  # replica -> (time left, its exposition text)

    def put(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def all(self) -> list:
        """The texts of the replicas that left theirs in the last :data:`_METRICS_STALE_SECONDS` (a replica gone since
        is forgotten)."""
        now = time.monotonic()
        self.texts = {key: (at, text) for key, (at, text) in self.texts.items() if now - at < _METRICS_STALE_SECONDS}
        return [text for _, text in self.texts.values()]


@serve.deployment
@serve.ingress()
class EngineReplica:
    """One replica: an :class:`~kvcache_op.serving.Engine` on the exported model and the app over it."""

    def __init__(self, model_path: str, tokenizer_dir: str, model_name: str, api_key, limits: dict,
                 engine_options: dict, drain_file: str = None, metrics_hub=None):
        from .engine import Engine
        from .server.metrics import ServerMetrics
        from .tokenizer import PlainText, load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.engine = Engine(model_path, tokenizer=PlainText(self.tokenizer), **engine_options)
        self.model_name, self.api_key, self.limits = model_name, api_key, ServerLimits(**limits)
        self.metrics = None
        if metrics_hub is not None:
            # Labelled with Ray's replica id (unique in the cluster) and the engine's process (the
            # x-kvcache-op-engine header of the replica's answers).
            replica = _replica_id()
            self.metrics = ServerMetrics(self.engine, labels={"replica": replica, "engine": str(os.getpid())},
                                         gather=lambda: asyncio.wait_for(_awaited(metrics_hub.all.remote()),
                                                                         _METRICS_GATHER_SECONDS))
            threading.Thread(target=_push_metrics, args=(metrics_hub, replica, self.metrics),
                             name="kvcache-op-metrics", daemon=True).start()
        if drain_file:
            threading.Thread(target=_close_when_drained, args=(self.engine, drain_file), name="kvcache-op-drain",
                             daemon=True).start()

    def __serve_build_asgi_app__(self):
        from .server import create_app

        return create_app(self.engine, self.tokenizer, model_name=self.model_name, api_key=self.api_key,
                          limits=self.limits, metrics=self.metrics)


async def _awaited(response):
    """``await response`` (a Ray Serve DeploymentResponse) as a coroutine, for ``asyncio.wait_for``."""
    return await response


def _replica_id() -> str:
    """Ray Serve's id of the replica this runs in."""
    replica = serve.get_replica_context().replica_id
    return str(getattr(replica, "unique_id", replica))


def _push_metrics(hub, replica: str, metrics) -> None:
    """Leaves ``metrics``' series at ``hub`` every :data:`_METRICS_PUSH_SECONDS` while the replica lives."""
    warned = False
    while True:
        try:
            response = hub.put.remote(replica, metrics.own_text())
            try:
                response.result(timeout_s=_METRICS_CALL_SECONDS)
            except TimeoutError:
                response.cancel()  # not left queued at a stalled hub
                raise
            warned = False
        except Exception:  # noqa: BLE001 - the hub is restarting, or the engine closing: the next round tries again
            if not warned:
                log.warning("replica %s could not leave its metrics for the others to answer", replica, exc_info=True)
                warned = True
        time.sleep(_METRICS_PUSH_SECONDS)


def _close_when_drained(engine, drain_file: str) -> None:
    """Once ``drain_file`` exists, closes ``engine`` (its requests end with finish_reason "abort", their replies
    whole) and then writes ``<drain_file>.<pid>`` to say so."""
    while not os.path.exists(drain_file):
        time.sleep(_DRAIN_POLL_SECONDS)
    engine.close(_DRAIN_CLOSE_SECONDS)
    pathlib.Path(f"{drain_file}.{os.getpid()}").touch()


def _drained_marks(drain_file: pathlib.Path) -> list:
    """The ``<drain_file>.<pid>`` files replicas wrote once their engines closed."""
    marks = drain_file.parent.glob(f"{glob.escape(drain_file.name)}.*")
    return [p for p in marks if p.name[len(drain_file.name) + 1:].isdigit()]


def drained_replicas(drain_file) -> int:
    """How many replicas have closed their engines since ``drain_file`` was made."""
    return len(_drained_marks(pathlib.Path(drain_file)))


def _check_engine_options(model_path, engine_options: dict) -> None:
    """``TypeError`` naming what is wrong when ``engine_options`` cannot be an :class:`~.engine.Engine`'s settings (a
    required one missing, one it does not take): said here, not as "Deploying application failed" from Ray Serve
    once every replica has tried. The values are checked by each replica's engine."""
    from .engine import Engine

    try:
        inspect.signature(Engine).bind(str(model_path), tokenizer=None, **engine_options)
    except TypeError as error:
        raise TypeError(f"engine options {sorted(engine_options)}: {error} (see kvcache_op.serving.Engine)") from None


def deployment(model_path, tokenizer_dir, *, replicas: int = 2, model_name: str, api_key: str = None,
               limits: ServerLimits = None, cpus_per_replica: float = 0, drain_file=None, **engine_options):
    """The Ray Serve application: ``replicas`` copies of the server, each with its own engine made with
    ``engine_options`` (``num_pages``, ``max_batch_tokens``, ``max_running``, ``intra_op_num_threads``, ...).
    ``cpus_per_replica`` is what each reserves from Ray's scheduler (0: none, so replicas share a small machine).

    Ray Serve sends each replica as many requests at once as the engine runs (``max_running``) plus those the
    server lets wait (``limits.max_queue``): the engine's admission and the server's 503 apply, not Ray Serve's
    default of 5 requests per replica, which would queue the rest in its router with no limit.

    ``GET /metrics``, which Ray Serve sends to one replica, answers every replica's series, each labelled with its
    ``replica`` (Ray Serve's id) and ``engine`` (the ``x-kvcache-op-engine`` of its answers), as each last left them
    at a :class:`MetricsHub` deployment (every second), and ``kvcache_op_replicas_reporting``; 503 where the hub does
    not answer within 2 s.

    ``drain_file`` (replicas on this machine): once that path exists, each replica closes its engine, ending its
    requests with finish_reason "abort" as a single server's shutdown does, and then writes ``<drain_file>.<pid>``
    (:func:`drained_replicas` counts them); shut Serve down after that. That path, and any ``<drain_file>.<pid>``,
    must not exist yet (``ValueError``: replicas would close their engines as they start); ``engine_options`` an
    Engine cannot take are a ``TypeError``, before Ray Serve starts anything."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    _check_engine_options(model_path, engine_options)
    if drain_file is not None:
        drain_file = pathlib.Path(drain_file)
        left = [p.name for p in ([drain_file] if drain_file.exists() else []) + _drained_marks(drain_file)]
        if left:  # replicas would close their engines as they start, and still answer /health
            raise ValueError(f"drain_file {str(drain_file)!r}: {', '.join(sorted(left))} already exist in its folder; "
                             "give a path of its own to each deployment")
    limits = limits or ServerLimits()
    running = engine_options.get("max_running") or DEFAULT_RUNNING
    return EngineReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica},
                                 max_ongoing_requests=running + limits.max_queue + _HEADROOM).bind(
        str(model_path), str(tokenizer_dir), model_name, api_key, dataclasses.asdict(limits), engine_options,
        None if drain_file is None else str(drain_file), MetricsHub.bind())
