"""OpenAI-style error bodies: every refusal is a JSON ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
(or 5xx) status, never a dropped connection."""

from __future__ import annotations


class APIError(Exception):
    """A refusal the server answers with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str = None,
                 code: str = None, headers: dict = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body OpenAI's clients parse (``openai.APIStatusError.body``)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str = None, code: str = None) -> APIError:
    """400: the request is malformed or a value is out of range."""
    return APIError(400, message, param=param, code=code)
