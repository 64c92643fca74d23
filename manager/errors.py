"""Typed errors of the cache manager."""


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages for a step; nothing was changed. The caller can preempt
    (finish or defer) a request and retry."""

    def __init__(self, needed: int, available: int):
        super().__init__(f"the step needs {needed} new page(s) but only {available} are free or evictable")
        self.needed = needed
        self.available = available


class UnknownRequest(KeyError):
    """A request id that was never added, or was already finished. ``args[0]`` is the id; the message says what
    it is (a ``KeyError``'s own message would be the id's repr alone)."""

    def __str__(self) -> str:
        return f"unknown request {self.args[0]!r}: never added, or already finished" if self.args else "unknown request"
