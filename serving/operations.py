"""Operating the embedded server: a Prometheus ``/metrics`` endpoint and API-key auth.

``create_app`` calls ``install_api_key`` and then ``install_metrics`` (in that order, so the metrics middleware
wraps the auth middleware and rejected requests are counted with their 401), and the launcher calls
``resolve_api_key`` (serving/config.py) and ``warn_if_exposed`` before it binds a socket.

Metrics. Each app gets its own ``CollectorRegistry``, never prometheus_client's global default: the test suite
builds many apps in one process, and a second app registering the same names on the global registry would
raise. Names follow vLLM's with ``overstory:`` in place of ``vllm:`` and the same label ``model_name``, so a
dashboard written for one watches the other by swapping the prefix (last column: what records it):

    overstory:prompt_tokens_total{model_name}                     vllm:prompt_tokens_total                    server
    overstory:generation_tokens_total{model_name}                 vllm:generation_tokens_total                server
    overstory:request_success_total{model_name,finished_reason}   vllm:request_success_total                  server
    overstory:time_to_first_token_seconds{model_name}             vllm:time_to_first_token_seconds            server
    overstory:num_requests_running{model_name}                    vllm:num_requests_running                   batcher
    overstory:num_requests_waiting{model_name}                    vllm:num_requests_waiting                   batcher
    overstory:e2e_request_latency_seconds{endpoint,status}        vllm:e2e_request_latency_seconds            middleware
    overstory:http_requests_total{endpoint,status}                http_requests_total (vLLM's instrumentator) middleware
    overstory:http_requests_in_flight                             none (vLLM counts per model only)           middleware

The middleware cannot know the model without reading (and buffering) the request body, so its metrics are
labelled by route template (``/v1/chat/completions``; ``unmatched`` for paths no route serves, so scanners
cannot grow the label set) and status only; the per-model series come from the ``ServerMetrics`` methods the
server and batcher call. vLLM measures its e2e latency inside the engine; ours runs from the request's arrival
at the app to its last byte, which for a client is the same thing. Its buckets are vLLM's with finer ones
below 0.3 s prepended, because embeddings and compression answer in milliseconds. ``/metrics`` and ``/health``
are not counted (as vLLM excludes them too): a scraper and a liveness probe would otherwise dominate the counts.

Both middlewares are pure ASGI rather than Starlette's ``BaseHTTPMiddleware``: with the latter, ``call_next``
returns as soon as the response headers exist, so a streamed (server-sent events) completion would be timed
to its first byte and counted while still streaming; a pure ASGI middleware awaits the whole response,
body included, and also avoids ``BaseHTTPMiddleware``'s re-wrapping of the body stream.

API key. When a key is set, every path under ``/v1`` needs ``Authorization: Bearer <key>``; ``/health``,
``/metrics`` and the docs stay open, and CORS preflights (``OPTIONS``) pass, as vLLM does (its
``AuthenticationMiddleware`` guards ``/v1``-style prefixes only): load balancers and Prometheus can then probe
and scrape without the key, and neither path says anything about requests beyond counts and model names. A
missing or wrong key gets OpenAI's 401 body with ``code: invalid_api_key``; the key is never echoed back.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from overstory.serving.config import API_KEY_ENV

PREFIX = "overstory:"
METRICS_PATH = "/metrics"
# Paths the request metrics leave out: the scraper's own requests and liveness probes.
UNCOUNTED_PATHS = (METRICS_PATH, "/health")
# Path prefixes the API key guards; a plain prefix match as in vLLM, so /v1beta would be guarded too.
PROTECTED_PREFIXES = ("/v1",)
UNMATCHED = "unmatched"

# vLLM's request-latency buckets (0.3 s .. 7680 s) with finer ones below for millisecond endpoints.
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's time-to-first-token buckets, so quantiles of both servers are read off the same bounds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)


class ServerMetrics:
    """The server's metrics on one registry; the server and batcher call the ``record_*``/``set_*`` methods.

    prometheus_client's metrics are thread-safe, so handlers running in the thread pool may call these
    while the middleware updates the HTTP metrics on the event loop.
    """

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(f"{PREFIX}http_requests", "HTTP requests answered, by route and status.",
                                     ["endpoint", "status"], registry=r)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Seconds from a request's arrival to its response's last byte (whole stream for SSE).",
            ["endpoint", "status"], buckets=E2E_BUCKETS, registry=r)
        self.http_requests_in_flight = Gauge(f"{PREFIX}http_requests_in_flight",
                                             "HTTP requests received and not yet fully answered.", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt (input) tokens processed.",
                                     ["model_name"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=r)
        self.request_success = Counter(f"{PREFIX}request_success", "Requests the engine finished, by reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.time_to_first_token = Histogram(f"{PREFIX}time_to_first_token_seconds",
                                             "Seconds from a request's arrival to its first generated token.",
                                             ["model_name"], buckets=TTFT_BUCKETS, registry=r)
        self.num_requests_running = Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch.",
                                          ["model_name"], registry=r)
        self.num_requests_waiting = Gauge(f"{PREFIX}num_requests_waiting", "Requests queued for a batch.",
                                          ["model_name"], registry=r)
        # no vLLM counterpart: vLLM's tool parsers return unparsable calls as content without counting them
        self.malformed_tool_calls = Counter(f"{PREFIX}malformed_tool_calls",
                                            "Tool-call blocks a model wrote that could not be parsed (returned "
                                            "as plain content).", ["model_name"], registry=r)

    def record_tokens(self, model: str, prompt: int, generated: int) -> None:
        """Count one request's tokens (``generated=0`` for embeddings, which still read their prompt)."""
        if prompt < 0 or generated < 0:
            raise ValueError(f"token counts cannot be negative (prompt={prompt}, generated={generated})")
        self.prompt_tokens.labels(model).inc(prompt)
        self.generation_tokens.labels(model).inc(generated)

    def record_first_token(self, model: str, seconds: float) -> None:
        self.time_to_first_token.labels(model).observe(seconds)

    def record_success(self, model: str, finished_reason: str, count: int = 1) -> None:
        """``count`` finished engine requests; ``finished_reason`` as OpenAI's ``finish_reason`` (stop, length,
        ...). A pooling request (embeddings, scores, compression) counts one per input with reason ``stop``: vLLM
        runs each input as its own engine request and finishes it stopped, so the two servers' counts compare."""
        self.request_success.labels(model, finished_reason).inc(count)

    def record_malformed_tool_calls(self, model: str, count: int) -> None:
        if count:
            self.malformed_tool_calls.labels(model).inc(count)

    def set_queue(self, model: str, running: int, waiting: int) -> None:
        """The batcher's current queue depth for ``model`` (absolute values, not increments)."""
        self.num_requests_running.labels(model).set(running)
        self.num_requests_waiting.labels(model).set(waiting)

    def observe_http(self, endpoint: str, status: int, seconds: float) -> None:
        self.http_requests.labels(endpoint, str(status)).inc()
        self.e2e_request_latency.labels(endpoint, str(status)).observe(seconds)

    def render(self, accept: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, negotiated on the scraper's ``Accept`` header (text
        format by default, OpenMetrics when asked), as prometheus_client's own HTTP handlers do."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def _app_path(scope: Scope) -> str:
    """The request path inside the app (without the ``root_path`` a proxy mounts it under)."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


def _route_template(scope: Scope, routes: Iterable[BaseRoute]) -> str:
    """The path template of the route that served (or would have served) the request."""
    # The router stores the route it matched in the (shared, mutable) scope ...
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    # ... but a request refused before routing (the API key's 401) never reached it: match it here. Routes
    # without a path (FastAPI's included routers) are skipped: their requests, if refused, count as unmatched.
    for route in routes:
        path = getattr(route, "path", None)
        if path and route.matches(scope)[0] != Match.NONE:
            return path
    return UNMATCHED


class _MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, uncounted: Iterable[str], routes: list[BaseRoute]):
        self.app = app
        self.metrics = metrics
        self.uncounted = frozenset(uncounted)
        self.routes = routes  # the app's live route list, so routes added after install count too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _app_path(scope) in self.uncounted:
            await self.app(scope, receive, send)
            return
        # If the app raises before starting a response, Starlette's outermost error middleware answers 500.
        status = 500

        async def watch_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        start = time.perf_counter()
        self.metrics.http_requests_in_flight.inc()
        try:
            # Returns only once the whole body (every SSE chunk) has been sent, or the client went away.
            await self.app(scope, receive, watch_status)
        finally:
            self.metrics.http_requests_in_flight.dec()
            self.metrics.observe_http(_route_template(scope, self.routes), status, time.perf_counter() - start)


def install_metrics(app: FastAPI, registry: CollectorRegistry | None = None, *,
                    uncounted: Iterable[str] = UNCOUNTED_PATHS) -> ServerMetrics:
    """Add ``GET /metrics`` and the request-metrics middleware to ``app``; returns the metrics (also at
    ``app.state.metrics``) for the server and batcher to record tokens and queue depth on.

    Call it before the app serves its first request (Starlette refuses middleware after that), and after
    ``install_api_key`` so that rejected requests are counted too.
    """
    metrics = ServerMetrics(registry)

    async def expose(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(content=body, headers={"Content-Type": content_type})

    app.add_api_route(METRICS_PATH, expose, methods=["GET"], include_in_schema=False)
    app.add_middleware(_MetricsMiddleware, metrics=metrics, uncounted=uncounted, routes=app.router.routes)
    app.state.metrics = metrics
    return metrics


def _auth_error(message: str) -> dict:
    """OpenAI's body for a missing or bad key."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


MISSING_KEY = "Missing API key: send it in the Authorization header as 'Authorization: Bearer <key>'."
WRONG_KEY = "Incorrect API key provided."


class _ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, protected: Iterable[str]):
        self.app = app
        # Compare digests, not the keys: equal lengths, so the comparison's time says nothing about the key's length.
        self.digest = hashlib.sha256(api_key.encode("utf-8")).digest()
        self.protected = tuple(protected)

    def _presented(self, scope: Scope) -> bytes | None:
        """The bearer token of the request's first Authorization header, or None without one."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":  # ASGI servers lower-case header names
                scheme, _, token = value.strip().partition(b" ")
                token = token.strip()
                return token if scheme.lower() == b"bearer" and token else None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS"
                or not _app_path(scope).startswith(self.protected)):
            await self.app(scope, receive, send)
            return
        token = self._presented(scope)
        if token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self.digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            # Closing before accepting makes the server refuse the handshake (HTTP 403); 1008: policy violation.
            await send({"type": "websocket.close", "code": 1008})
            return
        response = JSONResponse(status_code=401, content=_auth_error(MISSING_KEY if token is None else WRONG_KEY),
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def install_api_key(app: FastAPI, api_key: str | None, *, protected: Iterable[str] = PROTECTED_PREFIXES) -> None:
    """Require ``Authorization: Bearer <api_key>`` on every path starting with one of ``protected`` (``/v1``);
    no-op when ``api_key`` is empty or None."""
    if not api_key:
        return
    app.add_middleware(_ApiKeyMiddleware, api_key=api_key, protected=protected)


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine: ``localhost``, 127.0.0.0/8 or ::1 (also IPv4-mapped
    ``::ffff:127.x`` and ``[::1]``). Other names count as exposed: resolving them here would be a guess."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def warn_if_exposed(host: str, api_key: str | None, log: logging.Logger | logging.LoggerAdapter) -> bool:
    """Log a warning and return True when the server would listen beyond loopback without an API key."""
    if api_key or is_loopback(host):
        return False
    log.warning("serving on %r, reachable from other machines, without an API key: anyone who can reach it can "
                "use the models. Set the serve config's api_key or $%s, or bind to 127.0.0.1.",
                host, API_KEY_ENV)
    return True
