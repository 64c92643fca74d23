"""uvicorn's server, made to end the engine's requests when it begins to shut down."""

from __future__ import annotations

import asyncio

import uvicorn


class DrainingServer(uvicorn.Server):
    """A :class:`uvicorn.Server` for an app of :func:`~.app.create_app` over ``engine``: when it shuts down (a signal,
    or ``should_exit`` set) it first closes the engine, so the requests running or queued end with finish_reason
    "abort" (a stream with its last chunk and ``[DONE]``) while uvicorn waits for their replies. Plain
    ``uvicorn.run(app)`` closes the engine only once uvicorn has waited for the connections: the engine goes on
    admitting queued requests until uvicorn's graceful timeout cancels their handlers (a plain-text 500, streams cut
    mid-body)."""

    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None):
        await asyncio.to_thread(self.engine.close, 10.0)
        await super().shutdown(sockets=sockets)
