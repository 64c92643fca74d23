"""Scale-out on Ray Serve (the ``ray`` extra): the same OpenAI-compatible app, N replicas each with its own engine
(and its own cache), behind Ray Serve's HTTP proxy and router. Each replica builds its engine and app when it
starts (Ray Serve's late-bound ingress), so nothing heavy is pickled.

    app = deployment("model.onnx", "model.tokenizer", replicas=2, num_pages=256, model_name="tiny")
    serve.run(app, route_prefix="/")
"""

from __future__ import annotations

import dataclasses
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


@serve.deployment
@serve.ingress()
class EngineReplica:
    """One replica: an :class:`~kvcache_op.serving.Engine` on the exported model and the app over it."""

    def __init__(self, model_path: str, tokenizer_dir: str, model_name: str, api_key, limits: dict,
                 engine_options: dict, drain_file: str = None):
        from .engine import Engine
        from .tokenizer import PlainText, load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.engine = Engine(model_path, tokenizer=PlainText(self.tokenizer), **engine_options)
        self.model_name, self.api_key, self.limits = model_name, api_key, ServerLimits(**limits)
        if drain_file:
            threading.Thread(target=_close_when_drained, args=(self.engine, drain_file), name="kvcache-op-drain",
                             daemon=True).start()

    def __serve_build_asgi_app__(self):
        from .server import create_app

        return create_app(self.engine, self.tokenizer, model_name=self.model_name, api_key=self.api_key,
                          limits=self.limits)


def _close_when_drained(engine, drain_file: str) -> None:
    """Once ``drain_file`` exists, closes ``engine`` (its requests end with finish_reason "abort", their replies
    whole) and then writes ``<drain_file>.<pid>`` to say so."""
    while not os.path.exists(drain_file):
        time.sleep(_DRAIN_POLL_SECONDS)
    engine.close(_DRAIN_CLOSE_SECONDS)
    pathlib.Path(f"{drain_file}.{os.getpid()}").touch()


def drained_replicas(drain_file) -> int:
    """How many replicas have closed their engines since ``drain_file`` was made."""
    drain_file = pathlib.Path(drain_file)
    return len(list(drain_file.parent.glob(f"{drain_file.name}.*")))


def deployment(model_path, tokenizer_dir, *, replicas: int = 2, model_name: str, api_key: str = None,
               limits: ServerLimits = None, cpus_per_replica: float = 0, drain_file=None, **engine_options):
    """The Ray Serve application: ``replicas`` copies of the server, each with its own engine made with
    ``engine_options`` (``num_pages``, ``max_batch_tokens``, ``max_running``, ``intra_op_num_threads``, ...).
    ``cpus_per_replica`` is what each reserves from Ray's scheduler (0: none, so replicas share a small machine).

    Ray Serve sends each replica as many requests at once as the engine runs (``max_running``) plus those the
    server lets wait (``limits.max_queue``): the engine's admission and the server's 503 apply, not Ray Serve's
    default of 5 requests per replica, which would queue the rest in its router with no limit.

    ``drain_file`` (replicas on this machine): once that path exists, each replica closes its engine, ending its
    requests with finish_reason "abort" as a single server's shutdown does, and then writes ``<drain_file>.<pid>``
    (:func:`drained_replicas` counts them); shut Serve down after that."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    limits = limits or ServerLimits()
    running = engine_options.get("max_running") or DEFAULT_RUNNING
    return EngineReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica},
                                 max_ongoing_requests=running + limits.max_queue + _HEADROOM).bind(
        str(model_path), str(tokenizer_dir), model_name, api_key, dataclasses.asdict(limits), engine_options,
        None if drain_file is None else str(drain_file))
