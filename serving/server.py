"""The embedded OpenAI-compatible server (FastAPI) over an ``EmbeddedEngine``.

Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/compress``
(groups of child chunks in, compressed embeddings out), ``/v1/models`` and ``/health``; the
``model`` field names the role. The ``handle_*`` functions turn a validated
request into the OpenAI response dict; the routes and the client's in-process backend both call
them, so both paths answer with identical shapes. Errors use OpenAI's error body with a 4xx
status and a reason; an unexpected failure is logged and answered with a 500 without traceback.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from overstory.serving.config import ServeConfig
from overstory.serving.engine import EmbeddedEngine, GenerationResult, TokenLogprob
from overstory.serving.errors import BadRequest, RequestTooLarge, UnknownModel

log = logging.getLogger(__name__)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False

    def sampling(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "n": self.n, "stop": stop, "seed": self.seed}


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[str]  # a list runs as one batch; choices come prompt by prompt
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy API: k alternatives per token
    echo: bool = False


class EmbeddingRequest(BaseModel):
    model: str
    input: str | list[str]


class CompressRequest(BaseModel):
    """Groups of child chunks: ``input`` as texts, or ``embeddings`` as vectors (one of the two)."""

    model: str
    input: list[list[str]] | None = None
    embeddings: list[list[list[float]]] | None = None


class ApiError(Exception):
    """An error with the HTTP status and OpenAI error type it maps to."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _run(fn, *args, **kwargs):
    """Call the engine, mapping its errors to API errors."""
    try:
        return fn(*args, **kwargs)
    except UnknownModel as exc:
        raise ApiError(404, str(exc), "model_not_found", "model") from exc
    except RequestTooLarge as exc:
        raise ApiError(400, str(exc), "context_length_exceeded") from exc
    except BadRequest as exc:
        raise ApiError(400, str(exc), param=exc.param) from exc


def _check_stream(request: _Sampling) -> None:
    if request.stream:
        raise ApiError(400, "streaming is not supported by the embedded engine; send stream=false", param="stream")


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(*alt) for alt in t.top]}
                        for t in logprobs]}


def _completion_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    if logprobs is None:
        return None
    offsets = [0]
    for t in logprobs[:-1]:
        offsets.append(offsets[-1] + len(t.token))
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [dict(t.top) for t in logprobs], "text_offset": offsets}


def handle_chat(engine: EmbeddedEngine, request: ChatRequest) -> dict[str, Any]:
    _check_stream(request)
    sampling = request.sampling()
    sampling["max_tokens"] = request.max_completion_tokens or request.max_tokens
    if request.top_logprobs and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    sampling["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    result: GenerationResult = _run(engine.chat, request.model, [m.model_dump() for m in request.messages],
                                    **sampling)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                     "logprobs": _chat_logprobs(c.logprobs)} for i, c in enumerate(result.choices)],
        "usage": _usage(result.prompt_tokens, result.completion_tokens),
    }


def handle_completion(engine: EmbeddedEngine, request: CompletionRequest) -> dict[str, Any]:
    _check_stream(request)
    if request.echo:
        raise ApiError(400, "echo is not supported by the embedded engine; send echo=false", param="echo")
    result: GenerationResult = _run(engine.complete, request.model, request.prompt, **request.sampling(),
                                    logprobs=request.logprobs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": _completion_logprobs(c.logprobs)} for i, c in enumerate(result.choices)],
        "usage": _usage(result.prompt_tokens, result.completion_tokens),
    }


def handle_embeddings(engine: EmbeddedEngine, request: EmbeddingRequest) -> dict[str, Any]:
    texts = [request.input] if isinstance(request.input, str) else request.input
    result = _run(engine.embed, request.model, texts)
    return {
        "object": "list", "model": request.model,
        "data": [{"object": "embedding", "index": i, "embedding": vector.tolist()}
                 for i, vector in enumerate(result.embeddings)],
        "usage": _usage(result.prompt_tokens, 0),
    }


def handle_compress(engine: EmbeddedEngine, request: CompressRequest) -> dict[str, Any]:
    result = _run(engine.compress, request.model, request.input, request.embeddings)
    return {
        "object": "list", "model": request.model,
        "data": [{"object": "compressed_embedding", "index": i, "embedding": vector.tolist()}
                 for i, vector in enumerate(result.embeddings)],
        "usage": _usage(result.prompt_tokens, 0),
    }


def handle_health(engine: EmbeddedEngine) -> dict[str, Any]:
    return {"status": "ok", "roles": engine.roles}


def handle_models(engine: EmbeddedEngine) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": role, "object": "model", "owned_by": "overstory", "root": engine.config.roles[role].model}
        for role in engine.roles]}


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def create_app(source: EmbeddedEngine | ServeConfig) -> FastAPI:
    """The OpenAI-compatible app over a loaded engine, or over a config whose models it loads now."""
    engine = source if isinstance(source, EmbeddedEngine) else EmbeddedEngine(source)
    app = FastAPI(title="overstory embedded server", version="0.1.0")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(400, message, "invalid_request_error", where or None)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return _error(500, f"internal error ({exc.__class__.__name__}); see the server log", "server_error")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return handle_health(engine)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return handle_models(engine)

    @app.post("/v1/chat/completions")
    def chat(request: ChatRequest) -> dict[str, Any]:
        return handle_chat(engine, request)

    @app.post("/v1/completions")
    def completions(request: CompletionRequest) -> dict[str, Any]:
        return handle_completion(engine, request)

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict[str, Any]:
        return handle_embeddings(engine, request)

    @app.post("/v1/compress")
    def compress(request: CompressRequest) -> dict[str, Any]:
        return handle_compress(engine, request)

    return app
