"""The request errors every part of the embedded engine raises; the server maps them to HTTP answers
(``UnknownModel`` and ``NotFound`` -> 404, ``RequestTooLarge`` and ``BadRequest`` -> 400, ``Conflict`` -> 409,
``NotReady`` -> 503)."""

from __future__ import annotations


class UnknownModel(LookupError):
    """The request names a model (role) this engine does not serve."""


class BadRequest(ValueError):
    """A request the model cannot run (wrong endpoint for the role, bad message roles, a schema the
    grammar compiler refuses, ...); ``param`` names the request field at fault, when one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLarge(BadRequest):
    """Prompt plus requested completion exceed the model's context."""


class NotReady(RuntimeError):
    """A valid request the engine cannot serve yet (a grammar still compiling past its time limit on a busy
    machine): a 503, which clients retry, never a 400, which they take as their own fault. ``param`` as in
    ``BadRequest``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(LookupError):
    """A request names something the server does not hold (a document id of the served index): a 404."""


class Conflict(ValueError):
    """A request would create something the server already holds (a document id already indexed, without
    ``replace``): a 409."""
