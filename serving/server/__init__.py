"""The OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn; the ``serve`` extra): :func:`create_app`
builds the app, :class:`ServerLimits` bounds what a request may ask."""

from .app import ServerLimits, create_app

__all__ = ["ServerLimits", "create_app"]
