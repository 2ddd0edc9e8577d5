"""The in-process backend of ``serving.client.Client``: an ``EmbeddedEngine`` called through the server's
own request handlers, so a single-process job or a test gets the same validation and response shapes as
HTTP without a socket. Kept apart from the client so that an HTTP client never imports torch or the engine.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from overstory.serving import server
from overstory.serving.client import Client, ClientError
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.protocol import validation_message


class InProcessBackend:
    """Calls the engine through the server's own handlers: same validation, same response shapes."""

    ROUTES = {
        "/v1/chat/completions": (server.ChatRequest, server.handle_chat),
        "/v1/completions": (server.CompletionRequest, server.handle_completion),
        "/v1/embeddings": (server.EmbeddingRequest, server.handle_embeddings),
        "/v1/compress": (server.CompressRequest, server.handle_compress),
        "/score": (server.ScoreRequest, server.handle_scoring),
        "/v1/rerank": (server.RerankRequest, server.handle_scoring),
        "/tokenize": (server.TokenizeRequest, server.handle_tokenize),
        "/detokenize": (server.DetokenizeRequest, server.handle_detokenize),
    }

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine

    def post(self, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], int]:
        model, handler = self.ROUTES[path]
        try:
            return handler(self.engine, model.model_validate(payload)), 0
        except server.ApiError as exc:
            raise ClientError(exc.status, exc.message) from exc
        except ValidationError as exc:
            raise ClientError(400, validation_message(list(exc.errors()))[0]) from exc

    def get(self, path: str) -> list[dict[str, Any]]:
        answers = {"/v1/models": lambda: server.handle_models(self.engine), "/version": server.handle_version}
        return [answers.get(path, lambda: server.handle_health(self.engine))()]

    def close(self) -> None:
        pass


def in_process_client(engine: EmbeddedEngine) -> Client:
    """A client that calls ``engine`` in this process, through the server's own request handlers."""
    return Client(InProcessBackend(engine))
