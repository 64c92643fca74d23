"""Scale-out on Ray Serve (the ``ray`` extra): the same OpenAI-compatible app, N replicas each with its own engine
(and its own cache), behind Ray Serve's HTTP proxy and router. Each replica builds its engine and app when it
starts (Ray Serve's late-bound ingress), so nothing heavy is pickled.

    app = deployment("model.onnx", "model.tokenizer", replicas=2, num_pages=256, model_name="tiny")
    serve.run(app, route_prefix="/")
"""

from __future__ import annotations

import dataclasses

from ray import serve

from .server import ServerLimits


@serve.deployment
@serve.ingress()
class EngineReplica:
    """One replica: an :class:`~kvcache_op.serving.Engine` on the exported model and the app over it."""

    def __init__(self, model_path: str, tokenizer_dir: str, model_name: str, api_key, limits: dict,
                 engine_options: dict):
        from .engine import Engine
        from .tokenizer import PlainText, load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.engine = Engine(model_path, tokenizer=PlainText(self.tokenizer), **engine_options)
        self.model_name, self.api_key, self.limits = model_name, api_key, ServerLimits(**limits)

    def __serve_build_asgi_app__(self):
        from .server import create_app

        return create_app(self.engine, self.tokenizer, model_name=self.model_name, api_key=self.api_key,
                          limits=self.limits)


def deployment(model_path, tokenizer_dir, *, replicas: int = 2, model_name: str, api_key: str = None,
               limits: ServerLimits = None, cpus_per_replica: float = 0, **engine_options):
    """The Ray Serve application: ``replicas`` copies of the server, each with its own engine made with
    ``engine_options`` (``num_pages``, ``max_batch_tokens``, ``intra_op_num_threads``, ...). ``cpus_per_replica``
    is what each reserves from Ray's scheduler (0: none, so replicas share a small machine)."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be an integer >= 1, got {replicas!r}")
    limits = dataclasses.asdict(limits or ServerLimits())
    return EngineReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica}).bind(
        str(model_path), str(tokenizer_dir), model_name, api_key, limits, engine_options)
