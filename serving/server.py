"""The embedded OpenAI-compatible server (FastAPI) over an ``EmbeddedEngine``.

Endpoints: ``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events with
``stream: true``, see ``serving/streaming.py``; ``response_format``, ``tools`` and ``tool_choice`` on chat),
``/v1/embeddings``, ``/v1/compress`` (groups of child chunks in, compressed embeddings out), vLLM's ``/score``
and ``/v1/rerank`` for a cross-encoder scorer, vLLM's ``/tokenize``, ``/detokenize`` and ``/version``,
``/v1/models``, ``/health`` and ``/metrics``; the ``model`` field names the role. With a served retriever,
``/v1/retrieve``, ``/v1/documents`` and Search-R1's ``/retrieve`` too (``serving/retrieval_routes.py``).
The request models (``serving/protocol.py``) take every field of OpenAI's and vLLM's schemas: each takes effect,
labels the request, or is refused with a 400 naming it; a made-up field gets OpenAI's "Unrecognized request
argument". The ``handle_*`` functions turn a validated request into the OpenAI response dict; the routes and the
client's in-process backend both call them, so both paths answer with identical shapes. Errors use OpenAI's error
body with a 4xx status and a reason that names the field (unknown routes and wrong methods included);
an unexpected failure is logged and answered with a 500 without traceback.
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from overstory.serving.config import resolve_api_key
from overstory.serving.cross_encoder import RerankRequest, ScoreRequest, handle_rerank, handle_score
from overstory.serving.engine import EmbeddedEngine, GenerationResult, TokenLogprob
from overstory.serving.errors import BadRequest, Conflict, NotFound, NotReady, RequestTooLarge, UnknownModel
from overstory.serving.operations import (
    PROTECTED_PREFIXES,
    ServerMetrics,
    install_api_key,
    install_metrics,
)
from overstory.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    CompressRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingRequest,
    TokenizeRequest,
    validation_message,
)
from overstory.serving.retrieval_routes import SEARCH_R1_PATH, RetrievalService, mount_retrieval
from overstory.serving.streaming import chat_chunk_builder, completion_chunk_builder, stream_generation
from overstory.serving.tools import forces_a_call, parse_reply

log = logging.getLogger(__name__)


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
    except NotReady as exc:
        raise ApiError(503, str(exc), "service_unavailable", exc.param) from exc


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


def check_stream_options(request: SamplingRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "stream_options needs stream=true", param="stream_options")


def chat_options(request: ChatRequest) -> dict[str, Any]:
    """The engine's keyword arguments for a chat request (messages, tools, response_format, sampling)."""
    if request.top_logprobs and not request.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    check_stream_options(request)
    sampling = request.sampling()
    sampling["max_tokens"] = request.max_completion_tokens or request.max_tokens
    sampling["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    return {"messages": [m.as_dict() for m in request.messages], "tools": request.tools_offered(),
            "tool_choice": request.tool_choice, "response_format": request.response_format, **sampling}


def completion_options(request: CompletionRequest) -> dict[str, Any]:
    """The engine's keyword arguments for a completion request."""
    check_stream_options(request)
    return {"prompt": request.prompt, "response_format": request.response_format, **request.sampling(),
            "logprobs": request.logprobs}


def chat_message(request: ChatRequest, text: str) -> tuple[dict[str, Any], bool, int]:
    """The assistant message for a generated ``text``: tool calls parsed out of it when tools were offered.
    Returns (message, whether it holds tool calls, malformed tool-call blocks kept as plain content)."""
    tools = request.tools_offered()
    if not tools:
        return {"role": "assistant", "content": text}, False, 0
    # the request was validated when its generation started (engine.start_chat), so only the kind of choice matters
    parsed = parse_reply(text, tools, forced=forces_a_call(request.tool_choice))
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message, bool(parsed.tool_calls), parsed.malformed


def handle_chat(engine: EmbeddedEngine, request: ChatRequest, metrics: ServerMetrics | None = None) -> dict[str, Any]:
    if request.stream:
        raise ApiError(400, "stream=true is served over HTTP only", param="stream")
    result: GenerationResult = _run(engine.chat, request.model, **chat_options(request))
    if metrics is not None:
        _recorder(metrics, request.model)(result)
    choices = []
    for i, c in enumerate(result.choices):
        message, called, malformed = chat_message(request, c.text)
        if metrics is not None and malformed:
            metrics.record_malformed_tool_calls(request.model, malformed)
        choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(c.logprobs),
                        "finish_reason": "tool_calls" if called else c.finish_reason})
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": request.model, "choices": choices, "usage": _usage(result.prompt_tokens, result.completion_tokens),
    }


def handle_completion(engine: EmbeddedEngine, request: CompletionRequest,
                      metrics: ServerMetrics | None = None) -> dict[str, Any]:
    if request.stream:
        raise ApiError(400, "stream=true is served over HTTP only", param="stream")
    result: GenerationResult = _run(engine.complete, request.model, **completion_options(request))
    if metrics is not None:
        _recorder(metrics, request.model)(result)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": request.model,
        "choices": [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": _completion_logprobs(c.logprobs)} for i, c in enumerate(result.choices)],
        "usage": _usage(result.prompt_tokens, result.completion_tokens),
    }


def handle_embeddings(engine: EmbeddedEngine, request: EmbeddingRequest,
                      metrics: ServerMetrics | None = None) -> dict[str, Any]:
    """OpenAI's embeddings; ``dimensions`` only as the model's own (its vectors were not trained to be cut),
    ``encoding_format: base64`` as OpenAI's: the float32 bytes (little-endian, or vLLM's ``endianness``)."""
    if request.dimensions is not None:
        native = _run(engine.embedding_dimension, request.model)
        if request.dimensions != native:
            raise ApiError(400, f"model {request.model!r} does not support dimensions={request.dimensions}: its "
                           f"embeddings are {native}-dimensional and were not trained to be shortened",
                           param="dimensions")
    texts = [request.input] if isinstance(request.input, str) else request.input
    result = _run(engine.embed, request.model, texts)
    if metrics is not None:  # encoder passes count as prompt tokens, as vLLM counts its pooling requests
        metrics.record_tokens(request.model, result.prompt_tokens, 0)
        metrics.record_success(request.model, "stop", count=len(texts))
    return {
        "object": "list", "model": request.model,
        "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(vector, request)}
                 for i, vector in enumerate(result.embeddings)],
        "usage": _usage(result.prompt_tokens, 0),
    }


_BYTE_ORDER = {"native": "=", "little": "<", "big": ">"}


def _encode_vector(vector: np.ndarray, request: EmbeddingRequest) -> list[float] | str:
    """A vector as a list of floats, or base64 of its float32 bytes in the requested byte order (OpenAI's
    ``base64`` is little-endian; vLLM's default ``native`` is the same on the machines it runs on)."""
    if request.encoding_format == "float":
        return vector.tolist()
    order = "<" if request.endianness == "native" else _BYTE_ORDER[request.endianness]
    return base64.b64encode(vector.astype(f"{order}f4").tobytes()).decode("ascii")


def handle_compress(engine: EmbeddedEngine, request: CompressRequest,
                    metrics: ServerMetrics | None = None) -> dict[str, Any]:
    result = _run(engine.compress, request.model, request.input, request.embeddings)
    if metrics is not None:
        metrics.record_tokens(request.model, result.prompt_tokens, 0)
        metrics.record_success(request.model, "stop", count=len(result.embeddings))
    return {
        "object": "list", "model": request.model,
        "data": [{"object": "compressed_embedding", "index": i, "embedding": vector.tolist()}
                 for i, vector in enumerate(result.embeddings)],
        "usage": _usage(result.prompt_tokens, 0),
    }


def handle_scoring(engine: EmbeddedEngine, request: ScoreRequest | RerankRequest,
                   metrics: ServerMetrics | None = None) -> dict[str, Any]:
    """``/score`` or ``/v1/rerank`` on a cross-encoder role (vLLM's request and response shapes)."""
    model = _run(engine.cross_encoder, request.model)
    handler = handle_rerank if isinstance(request, RerankRequest) else handle_score
    response = _run(handler, model, request)
    if metrics is not None:
        metrics.record_tokens(request.model, response["usage"]["total_tokens"], 0)
        if isinstance(request, RerankRequest):  # every document is scored, whatever top_n returns
            pairs = 1 if isinstance(request.documents, str) else len(request.documents)
        else:
            pairs = len(response["data"])
        metrics.record_success(request.model, "stop", count=pairs)
    return response


def handle_health(engine: EmbeddedEngine) -> dict[str, Any]:
    return {"status": "ok", "roles": engine.roles}


def handle_models(engine: EmbeddedEngine) -> dict[str, Any]:
    """OpenAI's model list with vLLM's extras (``root``: the model behind the role, ``max_model_len``) and the
    role's ``dtype``, which vLLM does not list: a record names the weights' precision with the model."""
    created = int(time.time())
    return {"object": "list", "data": [
        {"id": role, "object": "model", "created": created, "owned_by": "overstory",
         "root": engine.config.roles[role].model, "parent": None, "max_model_len": engine.max_model_len(role),
         "dtype": engine.config.roles[role].dtype}
        for role in engine.roles]}


def handle_tokenize(engine: EmbeddedEngine, request: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
    role = _run(engine.chat_role, request.model)
    messages = None if request.messages is None else [m.as_dict() for m in request.messages]
    tokens = _run(engine.tokenize, role, request.prompt, messages, request.tools, request.add_special_tokens)
    strings = engine.tokenizer(role).convert_ids_to_tokens(tokens) if request.return_token_strs else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len(role), "tokens": tokens,
            "token_strs": strings}


def handle_detokenize(engine: EmbeddedEngine, request: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``{"prompt": text}``."""
    return {"prompt": _run(engine.detokenize, _run(engine.chat_role, request.model), request.tokens)}


def handle_version() -> dict[str, str]:
    """vLLM's ``/version`` shape, with overstory's version."""
    return {"version": version("overstory")}


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


async def _stream_chat(engine: EmbeddedEngine, request: ChatRequest, metrics: ServerMetrics) -> StreamingResponse:
    options = chat_options(request)
    if request.logprobs:
        raise ApiError(400, "logprobs are not streamed by the embedded engine; send stream=false", param="logprobs")
    tools = request.tools_offered()

    def finish(result: GenerationResult) -> list[tuple[int, dict[str, Any], str]]:
        last = []
        for i, choice in enumerate(result.choices):
            if not tools:
                last.append((i, {}, choice.finish_reason))
                continue
            message, called, malformed = chat_message(request, choice.text)
            metrics.record_malformed_tool_calls(request.model, malformed)
            delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
            if called:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            last.append((i, delta, "tool_calls" if called else choice.finish_reason))
        return last

    return await stream_generation(
        lambda **kw: _run(engine.start_chat, request.model, **kw), options, chat_chunk_builder(request.model),
        finish, _include_usage(request), _recorder(metrics, request.model), hold_back=bool(tools))


async def _stream_completion(engine: EmbeddedEngine, request: CompletionRequest,
                             metrics: ServerMetrics) -> StreamingResponse:
    options = completion_options(request)
    if request.logprobs is not None:
        raise ApiError(400, "logprobs are not streamed by the embedded engine; send stream=false", param="logprobs")

    def finish(result: GenerationResult) -> list[tuple[int, dict[str, Any], str]]:
        return [(i, {}, choice.finish_reason) for i, choice in enumerate(result.choices)]

    return await stream_generation(
        lambda **kw: _run(engine.start_completion, request.model, **kw), options,
        completion_chunk_builder(request.model), finish, _include_usage(request), _recorder(metrics, request.model))


def _include_usage(request: SamplingRequest) -> bool:
    return bool(request.stream_options and request.stream_options.include_usage)


def _recorder(metrics: ServerMetrics, model: str) -> Callable[[GenerationResult], None]:
    """What the metrics learn from one finished generation: tokens, finish reasons, time to first token."""

    def record(result: GenerationResult) -> None:
        metrics.record_tokens(model, result.prompt_tokens, result.completion_tokens)
        for choice in result.choices:
            metrics.record_success(model, choice.finish_reason)
        if result.time_to_first_token_s is not None:
            metrics.record_first_token(model, result.time_to_first_token_s)

    return record


def _handler(status: int, kind: str) -> Callable[[Request, Exception], Any]:
    """An exception handler answering ``status`` with the error's message (and ``param``, when it has one)."""

    async def answer(_: Request, exc: Exception) -> JSONResponse:
        return _error(status, str(exc), kind, getattr(exc, "param", None))

    return answer


def install_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape: our refusals, unknown paths and methods, invalid bodies, and anything unexpected
    (a 500 whose traceback goes to the server log, never to the client)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.param)

    # what the retrieval routes' service raises (the chat handlers map the engine's errors through _run)
    statuses = ((UnknownModel, 404, "model_not_found"), (NotFound, 404, "not_found_error"),
                (Conflict, 409, "conflict_error"),
                (BadRequest, 400, "invalid_request_error"), (NotReady, 503, "service_unavailable"))
    for error, status, kind in statuses:
        app.add_exception_handler(error, _handler(status, kind))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # unknown paths and wrong methods answer in OpenAI's error shape, not FastAPI's {"detail": ...}
        reasons = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, reasons.get(exc.status_code, str(exc.detail)), kind)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error while serving a request")
        return _error(500, f"internal error ({exc.__class__.__name__}); see the server log", "server_error")


def create_app(engine: EmbeddedEngine, retrieval: RetrievalService | None = None) -> FastAPI:
    """The OpenAI-compatible app over a loaded engine (whoever loaded the engine closes it), with the retrieval
    routes (``serving/retrieval_routes.py``) over ``retrieval`` when one is given."""
    app = FastAPI(title="overstory embedded server", version="0.1.0")
    # the key check goes in first so that the metrics middleware, outside it, counts refused requests too;
    # Search-R1's /retrieve is outside /v1, and guarded all the same
    guarded = (*PROTECTED_PREFIXES, SEARCH_R1_PATH) if retrieval is not None else PROTECTED_PREFIXES
    install_api_key(app, resolve_api_key(engine.config.api_key), protected=guarded)
    metrics = install_metrics(app)
    engine.watch_queues(metrics.set_queue)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return handle_health(engine)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return handle_models(engine)

    @app.get("/version")
    def show_version() -> dict[str, str]:
        return handle_version()

    # vLLM's tokenizer endpoints, at the paths vLLM serves them under
    @app.post("/tokenize")
    def tokenize(request: TokenizeRequest) -> dict[str, Any]:
        return handle_tokenize(engine, request)

    @app.post("/detokenize")
    def detokenize(request: DetokenizeRequest) -> dict[str, Any]:
        return handle_detokenize(engine, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: ChatRequest) -> dict[str, Any] | StreamingResponse:
        if request.stream:
            return await _stream_chat(engine, request, metrics)
        return await run_in_threadpool(handle_chat, engine, request, metrics)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest) -> dict[str, Any] | StreamingResponse:
        if request.stream:
            return await _stream_completion(engine, request, metrics)
        return await run_in_threadpool(handle_completion, engine, request, metrics)

    @app.post("/v1/embeddings")
    def embeddings(request: EmbeddingRequest) -> dict[str, Any]:
        return handle_embeddings(engine, request, metrics)

    @app.post("/v1/compress")
    def compress(request: CompressRequest) -> dict[str, Any]:
        return handle_compress(engine, request, metrics)

    # vLLM's scoring API, at the paths vLLM serves it under
    @app.post("/score")
    @app.post("/v1/score")
    def score(request: ScoreRequest) -> dict[str, Any]:
        return handle_scoring(engine, request, metrics)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    def rerank(request: RerankRequest) -> dict[str, Any]:
        return handle_scoring(engine, request, metrics)

    if retrieval is not None:
        mount_retrieval(app, retrieval)
    return app
