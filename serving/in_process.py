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


class InProcessBackend:
    """Calls the engine through the server's own handlers: same validation, same response shapes."""

    ROUTES = {
        "/v1/chat/completions": (server.ChatRequest, server.handle_chat),
        "/v1/completions": (server.CompletionRequest, server.handle_completion),
        "/v1/embeddings": (server.EmbeddingRequest, server.handle_embeddings),
        "/v1/compress": (server.CompressRequest, server.handle_compress),
        "/score": (server.ScoreRequest, server.handle_scoring),
        "/v1/rerank": (server.RerankRequest, server.handle_scoring),
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
            first = exc.errors()[0]
            raise ClientError(400, f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}") from exc

    def get(self, path: str) -> list[dict[str, Any]]:
        return [server.handle_models(self.engine) if path == "/v1/models" else server.handle_health(self.engine)]

    def close(self) -> None:
        pass


def in_process_client(engine: EmbeddedEngine) -> Client:
    """A client that calls ``engine`` in this process, through the server's own request handlers."""
    return Client(InProcessBackend(engine))
