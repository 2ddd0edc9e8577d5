"""One base URL for an ``engine: vllm`` stack: the front server answers for every role by model name.

With ``engine: vllm`` the chat roles run on vLLM's OpenAI servers, each on its own port, and the other roles
on the embedded server on the config's ``port``. Our own client reads ``stack.json`` (role -> URL), but a
third-party client (the official ``openai`` package, LangChain) takes one base URL. ``mount_front_door``
puts an ASGI middleware in front of the embedded app so that its port answers for the whole stack:

- a POST to an OpenAI or vLLM inference path (``PROXIED_PATHS``) whose JSON body's ``model`` is a role on a
  vLLM server goes to that server, streaming included: response chunks (server-sent events) are passed on as
  they arrive, and the upstream request is closed when the client goes away, so vLLM stops generating;
- ``GET /v1/models`` lists every role (the embedded app's and the upstreams', each upstream role with the
  ``dtype`` its vLLM server was started with, which vLLM does not list), ``GET /health`` answers 200
  only when the embedded app and every upstream answer, ``GET /metrics`` is the whole stack's Prometheus page
  (the embedded app's and every upstream's, each upstream's samples labelled with its URL, and the roles each
  answers for: ``serving/stack_metrics.py``), so a client behind the door can read vLLM's token counters;
- a body for such a role that names a field in neither OpenAI's nor vLLM's request schema of its path gets the
  400 the embedded server answers (``Unrecognized request argument supplied: <name>``, nested fields too) and
  never reaches vLLM, which would ignore the field with a warning; every field of either schema is passed on.
  vLLM's removed ``guided_*`` fields, which it ignores, are refused too. The schemas are the embedded server's
  request models (``REQUEST_MODELS``), which declare them all; a path without one (``/v1/responses``) is passed
  on unchecked;
- everything else, including a body that names no proxied role, goes to the embedded app unchanged (the body
  read to peek at ``model`` is replayed to it): a served retriever's routes (``/v1/retrieve``, ``/v1/documents``,
  Search-R1's ``/retrieve``) are the embedded app's, behind its own key check and in its error shape.

The model name is the role name on both sides (``serving/vllm.py`` serves every role under its own name,
as a served model name or a LoRA module), so a body is forwarded as it is. Upstream errors keep their status
and body; an upstream that cannot be reached answers 502, one that does not answer in time 504, both in
OpenAI's error shape. With an API key the front door checks the client's bearer token itself (else it would
relay anyone's request with the stack's key) and sends the key to the vLLM servers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import choose_encoder
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from overstory.serving.cross_encoder import RerankRequest, ScoreRequest
from overstory.serving.operations import METRICS_PATH
from overstory.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingRequest,
    TokenizeRequest,
    validation_message,
)
from overstory.serving.stack_metrics import merge_pages

log = logging.getLogger(__name__)

# The POST paths whose JSON body names a model: OpenAI's, and vLLM's own that a chat model may serve.
PROXIED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
    "/tokenize", "/detokenize", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
})
# The embedded server's request model of each proxied path: it declares every field of OpenAI's and vLLM's
# schema for that path, so its unknown fields are the names in neither.
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatRequest, "/v1/completions": CompletionRequest, "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/score": ScoreRequest, "/v1/score": ScoreRequest,
    "/rerank": RerankRequest, "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest,
}
# vLLM's guided decoding fields, removed in vLLM 0.12 and ignored there since (the embedded server refuses them)
REMOVED_BY_VLLM = frozenset(name for name in SamplingRequest.model_fields if name.startswith("guided_"))
# Headers that describe one connection, not the message (RFC 9110 section 7.6.1), and the ones the next hop
# sets itself (host, content-length of the request; date and server of the response, which uvicorn adds).
_REQUEST_SKIP = frozenset({b"connection", b"keep-alive", b"proxy-authorization", b"proxy-connection", b"te",
                           b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length",
                           b"authorization"})
_RESPONSE_SKIP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-connection", b"te",
                            b"trailer", b"transfer-encoding", b"upgrade", b"date", b"server"})
# /health and /metrics are polled (load balancers, Prometheus): a stuck upstream must make them fail fast, not hang
# for a generation's timeout
POLLED_TIMEOUT_S = 5.0


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, as the embedded server answers it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, kind))


def _base_url(url: str) -> str:
    """``http://host:port`` from a server URL with or without the /v1 suffix."""
    return url.rstrip("/").removesuffix("/v1")


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client disconnected before sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the already read body to the app once, then waits for the client as before."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _payload(body: bytes) -> dict[str, Any]:
    """The body's JSON object; empty when it is not JSON or not an object (the app answers with its own error)."""
    try:
        payload = json.loads(body)
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _model_of(body: bytes) -> str | None:
    model = _payload(body).get("model")
    return model if isinstance(model, str) else None


def _unknown_fields(model: type[BaseModel], payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """pydantic's ``extra_forbidden`` errors of ``payload`` under ``model``: its fields (nested ones too) that
    the model lacks. Other errors are left out: a value the embedded engine cannot honour is vLLM's to judge."""
    try:
        model.model_validate(payload)
    except ValidationError as exc:
        return [error for error in exc.errors() if error["type"] == "extra_forbidden"]
    return []


def door_refusal(path: str, payload: Mapping[str, Any]) -> JSONResponse | None:
    """The 400 for a body that names a field in neither OpenAI's nor vLLM's request schema of ``path`` (the
    embedded server's wording, every such field named), or None when it names none or no model checks ``path``.
    vLLM's removed ``guided_*`` fields, which it ignores, are refused with the embedded server's pointer."""
    model = REQUEST_MODELS.get(path)
    if model is None:
        return None
    if unknown := _unknown_fields(model, payload):
        message, param = validation_message(unknown)
    elif issubclass(model, SamplingRequest) and (removed := sorted(REMOVED_BY_VLLM & payload.keys())):
        param = removed[0]
        reason = model.model_fields[param].json_schema_extra["refused"]
        message = f"{param} is not supported: vLLM removed it and ignores it; {reason}"
    else:
        return None
    return JSONResponse(status_code=400, content=error_body(400, message, "invalid_request_error", param))


class FrontDoor:
    """ASGI middleware: requests for roles on vLLM servers go there, the rest to the wrapped app."""

    def __init__(self, app: ASGIApp, upstreams: Mapping[str, str], timeout_s: float = 600.0,
                 api_key: str | None = None, dtypes: Mapping[str, str] | None = None) -> None:
        self.app = app
        self.upstreams = {role: _base_url(url) for role, url in upstreams.items()}
        self.dtypes = dict(dtypes or {})  # role -> the dtype its vLLM server runs in, added to /v1/models
        # connect fails fast (a dead server is a 502 at once); a read may wait for a whole generation
        self.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        self.api_key = api_key or None
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        # created on first use, inside the server's event loop that it is bound to
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout,
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._http

    def _roles_by_upstream(self) -> dict[str, list[str]]:
        by_url: dict[str, list[str]] = {}
        for role, url in self.upstreams.items():
            by_url.setdefault(url, []).append(role)
        return by_url

    def _upstream_headers(self, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        kept = [(k, v) for k, v in headers if k.lower() not in _REQUEST_SKIP]
        return kept + [(b"authorization", f"Bearer {self.api_key}".encode())] if self.api_key else kept

    def _authorized(self, scope: Scope) -> bool:
        """Whether the request's bearer token is the key (always, without a key)."""
        if self.api_key is None:
            return True
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        # digests, not the keys, are compared: equal lengths, so the time taken says nothing about the key
        return scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(),
                                                                   hashlib.sha256(self.api_key.encode()).digest())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, self._close_on_shutdown(receive), send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == "/health":
            return await self._health(scope, send)
        if method == "GET" and path == "/v1/models":
            return await self._models(scope, send)
        if method == "GET" and path == METRICS_PATH and self.upstreams:
            return await self._metrics(scope, send)
        if method == "POST" and path in PROXIED_PATHS and self.upstreams:
            return await self._post(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A POST to a proxied path: to the upstream of the role it names (after the key and field checks), else
        to the wrapped app with the body replayed."""
        body = await _read_body(receive)
        if body is None:
            return None
        payload = _payload(body)
        role = payload.get("model")
        if not isinstance(role, str) or role not in self.upstreams:
            return await self.app(scope, _replay(body, receive), send)
        if not self._authorized(scope):
            return await _unauthorized()(scope, receive, send)
        if (refusal := door_refusal(scope["path"], payload)) is not None:
            return await refusal(scope, receive, send)
        return await self._proxy(scope, receive, send, body, self.upstreams[role])

    def _close_on_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown" and self._http is not None:
                await self._http.aclose()
                self._http = None
            return message

        return wrapped

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, body: bytes, base: str) -> None:
        query = scope.get("query_string", b"")
        url = base + scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        request = self.http.build_request(scope["method"], url, headers=self._upstream_headers(scope["headers"]),
                                          content=body)
        try:
            upstream = await self.http.send(request, stream=True)
        except httpx.TimeoutException:
            return await _error(504, f"{base} did not answer {scope['path']} within {self.timeout.read:.0f} s")(
                scope, receive, send)
        except httpx.HTTPError as exc:
            return await _error(502, f"cannot reach the server of this model at {base}: "
                                     f"{exc.__class__.__name__}: {exc}")(scope, receive, send)
        try:
            await send({"type": "http.response.start", "status": upstream.status_code,
                        "headers": [(k, v) for k, v in upstream.headers.raw if k.lower() not in _RESPONSE_SKIP]})
            # uvicorn's send() drops data silently once the client is gone, so the disconnect is watched
            # for and cancels the copy; leaving the block closes the upstream response, and vLLM aborts it
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
                try:
                    async for chunk in upstream.aiter_raw():  # raw: the bytes as they arrive, not re-encoded
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.HTTPError as exc:
                    # returning without the final message makes uvicorn drop the connection, so the client
                    # sees a truncated response rather than a complete-looking one
                    log.warning("%s%s broke off mid-response: %s: %s", base, scope["path"], exc.__class__.__name__,
                                exc)
                    group.cancel_scope.cancel()
                    return None
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()
        finally:
            await upstream.aclose()
        return None

    async def _inner(self, scope: Scope, path: str) -> tuple[int, bytes]:
        """Status and body of the wrapped app's answer to ``GET path`` (same headers as the request)."""
        status, chunks = 500, []

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app({**scope, "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b""},
                       receive, send)
        return status, b"".join(chunks)

    async def _get(self, url: str, timeout_s: float | None = None) -> httpx.Response | str:
        """The upstream's response, or why there is none."""
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            return await self.http.get(url, headers=headers, timeout=timeout_s or self.timeout)
        except httpx.HTTPError as exc:
            return f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__

    async def _health(self, scope: Scope, send: Send) -> None:
        status, body = await self._inner(scope, "/health")
        try:
            inner = json.loads(body) if body else {}
        except ValueError:
            inner = {}
        by_url = self._roles_by_upstream()
        answers = await asyncio.gather(*(self._get(f"{url}/health", POLLED_TIMEOUT_S) for url in by_url))
        upstreams = {url: "ok" if isinstance(a, httpx.Response) and a.status_code == 200
                     else (a if isinstance(a, str) else f"status {a.status_code}") for url, a in zip(by_url, answers)}
        ok = status == 200 and all(state == "ok" for state in upstreams.values())
        content = {**(inner if isinstance(inner, dict) else {}), "status": "ok" if ok else "unavailable",
                   "roles": [*(inner.get("roles", []) if isinstance(inner, dict) else []), *self.upstreams],
                   "upstreams": upstreams}
        await JSONResponse(status_code=200 if ok else 503, content=content)(scope, _no_body, send)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        """The whole stack's Prometheus page in the format the scraper's ``Accept`` asks for; a 502 naming the
        server whose page cannot be read or merged (a page without a server's counters would read as that
        server having done nothing)."""
        headers = dict(scope["headers"])
        # the app's page in the text format, which the merge parses; the merged page is encoded as asked below
        status, body = await self._inner({**scope, "headers": [(k, v) for k, v in scope["headers"]
                                                               if k.lower() != b"accept"]}, METRICS_PATH)
        no_page = status in (404, 405)  # a front server with no embedded role (create_front_app) has none of its own
        if status != 200 and not no_page:
            return await _error(502, f"the embedded server's {METRICS_PATH} answered {status}")(scope, _no_body, send)
        by_url = self._roles_by_upstream()
        pages = {}
        answers = await asyncio.gather(*(self._get(f"{url}{METRICS_PATH}", POLLED_TIMEOUT_S) for url in by_url))
        for url, answer in zip(by_url, answers):
            if isinstance(answer, str) or answer.status_code != 200:
                why = answer if isinstance(answer, str) else f"status {answer.status_code}"
                return await _error(502, f"cannot read the metrics of {url}: {why}")(scope, _no_body, send)
            pages[url] = answer.text
        try:
            registry = merge_pages("" if no_page else body.decode(), pages, by_url)
        except ValueError as exc:
            return await _error(502, str(exc))(scope, _no_body, send)
        encoder, content_type = choose_encoder(headers.get(b"accept", b"").decode("latin-1"))
        await Response(encoder(registry), headers={"Content-Type": content_type})(scope, _no_body, send)
        return None

    async def _models(self, scope: Scope, send: Send) -> None:
        if not self._authorized(scope):
            return await _unauthorized()(scope, _no_body, send)
        status, body = await self._inner(scope, "/v1/models")
        if status != 200:  # the embedded app's own error (its auth, say) is the answer
            return await _raw(status, body)(scope, _no_body, send)
        data = list(json.loads(body).get("data", []))
        seen = {model.get("id") for model in data}
        by_url = self._roles_by_upstream()
        for url, answer in zip(by_url, await asyncio.gather(*(self._get(f"{url}/v1/models") for url in by_url))):
            if isinstance(answer, str) or answer.status_code != 200:
                why = answer if isinstance(answer, str) else f"status {answer.status_code}: {answer.text[:200]}"
                return await _error(502, f"cannot list the models of {url}: {why}")(scope, _no_body, send)
            # only the roles: a server that serves roles as LoRA modules also lists its base model's name
            listed = [m for m in answer.json().get("data", []) if m.get("id") in by_url[url] and m["id"] not in seen]
            for model in listed:
                if model["id"] in self.dtypes:
                    model.setdefault("dtype", self.dtypes[model["id"]])
            data.extend(listed)
            seen.update(m["id"] for m in listed)
        await JSONResponse({"object": "list", "data": data})(scope, _no_body, send)
        return None


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _unauthorized() -> JSONResponse:
    return _error(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                  "invalid_request_error")


def _raw(status: int, body: bytes) -> Response:
    return Response(body, status_code=status, media_type="application/json")


def mount_front_door(app: FastAPI, upstreams: Mapping[str, str], timeout_s: float = 600.0,
                     api_key: str | None = None, dtypes: Mapping[str, str] | None = None) -> None:
    """Make ``app`` answer for the roles in ``upstreams`` (role -> vLLM server URL) too, ahead of its own routes.

    ``timeout_s``: how long an upstream may take to answer (a whole non-streamed generation) or between two
    chunks of a stream. ``api_key``: the key clients must send for proxied requests and /v1/models, and the
    key sent to the upstreams. ``dtypes``: role -> the dtype its server was started with, listed with the role
    in /v1/models. Call before the app serves its first request (Starlette builds its middleware stack then).
    """
    app.add_middleware(FrontDoor, upstreams=dict(upstreams), timeout_s=timeout_s, api_key=api_key,
                       dtypes=dict(dtypes or {}))


def create_front_app() -> FastAPI:
    """The front server of a stack with no embedded role: every known model is proxied, any other is unknown."""
    app = FastAPI(title="overstory front door", version="0.1.0")

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "roles": []}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    @app.post("/{path:path}")
    async def unknown(request: Request) -> JSONResponse:
        model = _model_of(await request.body())
        return _error(404, f"model {model!r} is not served here", "model_not_found")

    return app
