"""The request errors every part of the embedded engine raises; the server maps them to 4xx answers
(``UnknownModel`` -> 404, ``RequestTooLarge`` and ``BadRequest`` -> 400)."""

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
