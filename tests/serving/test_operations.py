"""The server's operations layer (``/metrics``, API key, exposure warning) on a toy FastAPI app: no model needed.

The toy app has a JSON route, a path-parameter route, a server-sent-events route that sleeps between chunks
(so a middleware that stopped timing at the headers would be caught), a route that raises, and a websocket.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from starlette.websockets import WebSocketDisconnect

from overstory.serving.config import API_KEY_ENV, resolve_api_key
from overstory.serving.operations import (
    MISSING_KEY,
    WRONG_KEY,
    ServerMetrics,
    install_api_key,
    install_metrics,
    warn_if_exposed,
)
from tests.serving.metrics_page import parse, value

KEY = "sk-test-0123456789"
CHUNKS = 3
CHUNK_PAUSE = 0.05  # seconds between SSE chunks; the stream lasts at least CHUNKS * CHUNK_PAUSE


def toy_app(api_key: str | None = None) -> tuple[FastAPI, ServerMetrics, list[dict[str, float | None]]]:
    """The toy app with auth then metrics installed as create_app does; the list collects what the
    streaming route saw in the registry while it was still streaming."""
    app = FastAPI()
    during_stream: list[dict[str, float | None]] = []

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/v1/echo")
    def echo(body: dict) -> dict:
        return {"echo": body}

    @app.get("/v1/items/{item_id}")
    def item(item_id: int) -> dict:
        return {"id": item_id}

    @app.get("/v1/stream")
    def stream() -> StreamingResponse:
        async def events():
            for i in range(CHUNKS):
                yield f"data: {i}\n\n"
                await asyncio.sleep(CHUNK_PAUSE)
            registry = app.state.metrics.registry
            during_stream.append({
                "in_flight": registry.get_sample_value("overstory:http_requests_in_flight"),
                "counted": registry.get_sample_value("overstory:http_requests_total",
                                                     {"endpoint": "/v1/stream", "status": "200"}),
            })
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/boom")
    def boom() -> dict:
        raise RuntimeError("boom")

    @app.websocket("/v1/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("hello")
        await socket.close()

    install_api_key(app, api_key)
    metrics = install_metrics(app)
    return app, metrics, during_stream


def scrape(client: TestClient, **headers: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` parsed: (sample name, sorted labels) -> value."""
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return parse(response.text)


def test_metrics_endpoint_speaks_the_exposition_format() -> None:
    app, metrics, _ = toy_app()
    with TestClient(app) as client:
        plain = client.get("/metrics")
        assert plain.status_code == 200
        assert plain.headers["content-type"].startswith("text/plain")
        names = {family.name for family in text_string_to_metric_families(plain.text)}
        assert {"overstory:http_requests", "overstory:e2e_request_latency_seconds",
                "overstory:http_requests_in_flight", "overstory:prompt_tokens", "overstory:generation_tokens",
                "overstory:time_to_first_token_seconds", "overstory:num_requests_running",
                "overstory:num_requests_waiting", "overstory:request_success"} <= names
        # a scraper asking for OpenMetrics gets it (content negotiation, as prometheus_client's own handlers)
        open_metrics = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        assert open_metrics.headers["content-type"].startswith("application/openmetrics-text")
        assert open_metrics.text.rstrip().endswith("# EOF")
    assert app.state.metrics is metrics
    assert "/metrics" not in app.openapi()["paths"]


def test_requests_counted_by_route_template_and_status() -> None:
    app, _, _ = toy_app()
    with TestClient(app) as client:
        for i in range(4):
            assert client.post("/v1/echo", json={"i": i}).status_code == 200
        assert client.post("/v1/echo", content=b"not json").status_code == 422
        for i in range(2):
            assert client.get(f"/v1/items/{i}").status_code == 200
        assert client.get("/v1/nowhere").status_code == 404
        assert client.get("/health").status_code == 200
        client.get("/metrics")
        samples = scrape(client)
    total = "overstory:http_requests_total"
    assert value(samples, total, endpoint="/v1/echo", status="200") == 4
    assert value(samples, total, endpoint="/v1/echo", status="422") == 1
    # two ids, one series: labelled by the route's template, not the raw path
    assert value(samples, total, endpoint="/v1/items/{item_id}", status="200") == 2
    assert value(samples, total, endpoint="unmatched", status="404") == 1
    endpoints = {dict(labels).get("endpoint") for name, labels in samples if name == total}
    assert endpoints == {"/v1/echo", "/v1/items/{item_id}", "unmatched"}  # neither /metrics nor /health
    # one latency observation per counted request, series by series
    latency = "overstory:e2e_request_latency_seconds"
    for name, labels in list(samples):
        if name == total:
            assert samples[(f"{latency}_count", labels)] == samples[(name, labels)]
            assert samples[(f"{latency}_bucket", tuple(sorted([*labels, ("le", "+Inf")])))] == samples[(name, labels)]
    assert value(samples, "overstory:http_requests_in_flight") == 0


def test_streamed_response_counted_once_after_it_ends() -> None:
    app, _, during_stream = toy_app()
    with TestClient(app) as client:
        response = client.get("/v1/stream")
        samples = scrape(client)
    assert response.status_code == 200
    assert response.text.count("data: ") == CHUNKS + 1
    # while the last chunk was still to be sent the request was in flight and not yet counted ...
    assert during_stream == [{"in_flight": 1.0, "counted": None}]
    # ... and once the stream ended it was counted exactly once, timed over the whole stream
    assert value(samples, "overstory:http_requests_total", endpoint="/v1/stream", status="200") == 1
    labels = {"endpoint": "/v1/stream", "status": "200"}
    assert value(samples, "overstory:e2e_request_latency_seconds_count", **labels) == 1
    assert value(samples, "overstory:e2e_request_latency_seconds_sum", **labels) >= CHUNKS * CHUNK_PAUSE
    assert value(samples, "overstory:http_requests_in_flight") == 0


def test_unhandled_error_counted_as_500_and_leaves_nothing_in_flight() -> None:
    app, _, _ = toy_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/v1/boom").status_code == 500
        samples = scrape(client)
    assert value(samples, "overstory:http_requests_total", endpoint="/v1/boom", status="500") == 1
    assert value(samples, "overstory:http_requests_in_flight") == 0


def test_server_side_metrics_show_up_per_model() -> None:
    app, metrics, _ = toy_app()
    metrics.record_tokens("planner", prompt=12, generated=5)
    metrics.record_tokens("planner", prompt=8, generated=0)
    metrics.record_tokens("embedder", prompt=30, generated=0)
    metrics.record_first_token("planner", 0.07)
    metrics.record_success("planner", "stop")
    metrics.set_queue("planner", running=3, waiting=7)
    metrics.set_queue("planner", running=1, waiting=2)  # absolute depth: replaces, does not add
    with pytest.raises(ValueError, match="negative"):
        metrics.record_tokens("planner", prompt=-1, generated=0)
    with TestClient(app) as client:
        samples = scrape(client)
    assert value(samples, "overstory:prompt_tokens_total", model_name="planner") == 20
    assert value(samples, "overstory:generation_tokens_total", model_name="planner") == 5
    assert value(samples, "overstory:prompt_tokens_total", model_name="embedder") == 30
    assert value(samples, "overstory:time_to_first_token_seconds_count", model_name="planner") == 1
    assert value(samples, "overstory:time_to_first_token_seconds_bucket", model_name="planner", le="0.08") == 1
    assert value(samples, "overstory:time_to_first_token_seconds_bucket", model_name="planner", le="0.06") == 0
    assert value(samples, "overstory:request_success_total", model_name="planner", finished_reason="stop") == 1
    assert value(samples, "overstory:num_requests_running", model_name="planner") == 1
    assert value(samples, "overstory:num_requests_waiting", model_name="planner") == 2


def test_each_app_has_its_own_registry() -> None:
    first, first_metrics, _ = toy_app()
    second, _, _ = toy_app()  # would raise "Duplicated timeseries" on a shared registry
    with TestClient(first) as client:
        client.post("/v1/echo", json={})
    first_metrics.record_tokens("planner", 1, 1)
    with TestClient(second) as client:
        samples = scrape(client)
    assert value(samples, "overstory:http_requests_total", endpoint="/v1/echo", status="200") is None
    assert value(samples, "overstory:prompt_tokens_total", model_name="planner") is None
    assert not [m for m in REGISTRY.collect() if m.name.startswith("overstory:")]


def test_missing_key_is_refused_with_openai_error_body() -> None:
    app, _, _ = toy_app(api_key=KEY)
    with TestClient(app) as client:
        response = client.post("/v1/echo", json={"a": 1})
        not_bearer = client.post("/v1/echo", json={"a": 1}, headers={"Authorization": f"Basic {KEY}"})
        probing = client.get("/v1/no-such-route")  # refused before routing can say 404
        samples = scrape(client)
    assert response.status_code == 401
    assert response.json() == {"error": {"message": MISSING_KEY, "type": "invalid_request_error", "param": None,
                                         "code": "invalid_api_key"}}
    assert response.headers["www-authenticate"] == "Bearer"
    assert not_bearer.status_code == 401 and not_bearer.json()["error"]["message"] == MISSING_KEY
    assert probing.status_code == 401
    # metrics wrap auth (create_app's order), so refused requests are visible on the dashboard, under the route
    # they were refused for (matched by the middleware: auth answered before the router ran)
    assert value(samples, "overstory:http_requests_total", endpoint="/v1/echo", status="401") == 2
    assert value(samples, "overstory:http_requests_total", endpoint="unmatched", status="401") == 1


@pytest.mark.parametrize("wrong", ["sk-wrong", KEY[:-1], KEY + "0", KEY.upper(), ""])
def test_wrong_key_is_refused(wrong: str) -> None:
    app, _, _ = toy_app(api_key=KEY)
    with TestClient(app) as client:
        response = client.get("/v1/items/1", headers={"Authorization": f"Bearer {wrong}"})
    assert response.status_code == 401
    error = response.json()["error"]
    assert error == {"message": MISSING_KEY if not wrong else WRONG_KEY, "type": "invalid_request_error",
                     "param": None, "code": "invalid_api_key"}
    assert KEY not in response.text


def test_right_key_passes_and_open_paths_need_none() -> None:
    app, _, _ = toy_app(api_key=KEY)
    with TestClient(app) as client:
        assert client.post("/v1/echo", json={"a": 1}, headers={"Authorization": f"Bearer {KEY}"}).json() == {
            "echo": {"a": 1}}
        # the scheme is case-insensitive (RFC 7235); surrounding spaces are not part of the key
        assert client.get("/v1/items/2", headers={"Authorization": f"bearer  {KEY} "}).status_code == 200
        streamed = client.get("/v1/stream", headers={"Authorization": f"Bearer {KEY}"})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        assert client.get("/health").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/openapi.json").status_code == 200
        # CORS preflights carry no credentials: passed through to the app (here 405: no CORS middleware)
        assert client.options("/v1/echo").status_code == 405


def test_websocket_under_v1_needs_the_key() -> None:
    app, _, _ = toy_app(api_key=KEY)
    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as refused:
            with client.websocket_connect("/v1/ws") as socket:
                socket.receive_text()
        assert refused.value.code == 1008
        with client.websocket_connect("/v1/ws", headers={"Authorization": f"Bearer {KEY}"}) as socket:
            assert socket.receive_text() == "hello"


@pytest.mark.parametrize("key", [None, ""])
def test_no_key_means_no_auth(key: str | None) -> None:
    bare = FastAPI()
    install_api_key(bare, key)
    assert bare.user_middleware == []
    app, _, _ = toy_app(api_key=key)
    with TestClient(app) as client:
        assert client.post("/v1/echo", json={}).status_code == 200


def test_resolve_api_key_prefers_config_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key("") is None
    assert resolve_api_key(None) is None
    assert resolve_api_key("from-config") == "from-config"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key("from-config") == "from-config"
    assert resolve_api_key("") == "from-env"
    assert resolve_api_key("   ") == "from-env"  # a blank config value is unset, not a key of spaces
    monkeypatch.setenv(API_KEY_ENV, " \n")
    assert resolve_api_key("") is None


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "localhost", "LOCALHOST", "::1", "[::1]",
                                  "::ffff:127.0.0.1"])
def test_loopback_hosts_are_not_warned_about(host: str, caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test_operations.loopback")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn_if_exposed(host, None, log) is False
    assert caplog.records == []


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.org", "128.0.0.1", ""])
def test_exposed_host_without_key_warns(host: str, caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test_operations.exposed")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert warn_if_exposed(host, None, log) is True
        assert warn_if_exposed(host, "", log) is True
        assert warn_if_exposed(host, KEY, log) is False  # a key makes exposure deliberate
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.WARNING]
    assert API_KEY_ENV in caplog.records[0].getMessage()
