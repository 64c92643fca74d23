"""The OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn; the ``serve`` extra): :func:`create_app`
builds the app, :class:`ServerLimits` bounds what a request may ask, :class:`DrainingServer` runs it under uvicorn and
ends the engine's requests as whole replies when it shuts down."""

from .app import ServerLimits, create_app
from .draining import DrainingServer

__all__ = ["DrainingServer", "ServerLimits", "create_app"]
