"""The client's retries, backoff, timeouts, routing and accounting against a server that fails on purpose.

The server here is a small FastAPI app, not the model server: these tests need failures on demand.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from overstory.serving.client import BACKOFF_ENV, DEFAULT_BACKOFF_S, Client, ClientError, HttpBackend
from overstory.serving.launch import serve_in_background
from overstory.serving.ports import free_port

CHAT_REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
MESSAGES = [{"role": "user", "content": "hi"}]


def flaky_app(calls: dict[str, int]) -> FastAPI:
    """/v1/chat/completions behaves by model name: 'flaky-N' fails N times with 503, 'down' always 503,
    'slow' sleeps past the client timeout, 'bad' answers 400, anything else answers at once."""
    app = FastAPI()
    lock = threading.Lock()

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        model = body["model"]
        with lock:
            calls[model] = calls.get(model, 0) + 1
            count = calls[model]
        if model.startswith("flaky-") and count <= int(model.split("-")[1]):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if model == "down":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if model == "slow":
            time.sleep(1.0)
        if model == "bad":
            return JSONResponse({"error": {"message": "bad request, do not retry"}}, status_code=400)
        return CHAT_REPLY

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "generator", "object": "model"}]}

    @app.get("/health")
    def health():
        return {"status": "ok"}

    return app


@pytest.fixture(scope="module")
def flaky():
    calls: dict[str, int] = {}
    with serve_in_background(flaky_app(calls)) as url:
        yield url, calls


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds of every ``time.sleep`` this test's thread calls (the client's backoff), still slept; the
    server's threads sleep unrecorded."""
    slept: list[float] = []
    real, caller = time.sleep, threading.get_ident()

    def sleep(seconds: float) -> None:
        if threading.get_ident() == caller:
            slept.append(seconds)
        real(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    return slept


def test_retries_until_success(flaky, sleeps: list[float]) -> None:
    url, calls = flaky
    client = Client.from_url(url, max_retries=3, backoff_s=0.01)
    assert client.chat("flaky-2", MESSAGES).text == "ok"
    assert calls["flaky-2"] == 3
    # one backoff before each retry, doubling: backoff_s * 2**attempt, times a jitter in [0.5, 1.5)
    assert len(sleeps) == 2 and 0.005 <= sleeps[0] < 0.015 and 0.01 <= sleeps[1] < 0.03
    stats = client.stats.summary()["flaky-2"]
    assert stats["retries"] == 2 and stats["failures"] == 0 and stats["completion_tokens"] == 1


def test_gives_up_after_max_retries(flaky, sleeps: list[float]) -> None:
    url, calls = flaky
    client = Client.from_url(url, max_retries=2, backoff_s=0.01)
    with pytest.raises(ClientError) as error:
        client.chat("down", MESSAGES)
    assert error.value.status == 503 and "overloaded" in error.value.reason and error.value.retries == 2
    assert calls["down"] == 3 and len(sleeps) == 2  # no backoff after the last attempt
    stats = client.stats.summary()["down"]
    assert stats["failures"] == 1 and stats["retries"] == 2


def test_the_backoff_a_caller_does_not_name_comes_from_the_environment(flaky, sleeps: list[float],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs' clients name no backoff: ``$OVERSTORY_HTTP_BACKOFF_S`` sets it (0.5 s without it); a value that is not
    a number of seconds >= 0 is refused naming the variable."""
    url, calls = flaky
    monkeypatch.delenv(BACKOFF_ENV, raising=False)
    assert HttpBackend(url).backoff_s == DEFAULT_BACKOFF_S == 0.5
    monkeypatch.setenv(BACKOFF_ENV, "0.02")
    client = Client.from_url(url, max_retries=2)
    assert client.chat("flaky-1", MESSAGES).text == "ok" and calls["flaky-1"] == 2
    assert len(sleeps) == 1 and 0.01 <= sleeps[0] < 0.03
    assert HttpBackend(url, backoff_s=0.3).backoff_s == 0.3  # a caller's own value wins
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(BACKOFF_ENV, bad)
        refused = rf"\$OVERSTORY_HTTP_BACKOFF_S must be a number of seconds >= 0, got '{bad}'"
        with pytest.raises(ValueError, match=refused):
            HttpBackend(url)
    with pytest.raises(ValueError, match="backoff_s must be >= 0, got -0.1"):
        HttpBackend(url, backoff_s=-0.1)


def test_client_errors_are_not_retried(flaky) -> None:
    url, calls = flaky
    with pytest.raises(ClientError) as error:
        Client.from_url(url, max_retries=3, backoff_s=0.01).chat("bad", MESSAGES)
    assert error.value.status == 400 and "do not retry" in error.value.reason and calls["bad"] == 1


def test_timeouts_are_retried_then_fail(flaky) -> None:
    url, calls = flaky
    client = Client.from_url(url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
    with pytest.raises(ClientError) as error:
        client.chat("slow", MESSAGES)
    # the client's timeout ended each attempt ('slow' answers after 1 s): a status of 0, httpx's timeout named
    assert error.value.status == 0 and "ReadTimeout" in error.value.reason and error.value.retries == 1
    assert calls["slow"] == 2


def test_connection_refused_is_bounded() -> None:
    client = Client.from_url(f"http://127.0.0.1:{free_port()}/v1", max_retries=2, backoff_s=0.01)
    with pytest.raises(ClientError, match="ConnectError"):
        client.chat("generator", MESSAGES)
    assert not client.health()


def test_per_role_urls(flaky) -> None:
    url, _ = flaky
    client = Client.from_url({"generator": f"{url}/v1", "planner": url, "scorer": f"http://127.0.0.1:{free_port()}"},
                             max_retries=0)
    assert client.chat("generator", MESSAGES).text == client.chat("planner", MESSAGES).text == "ok"
    with pytest.raises(ClientError, match="ConnectError"):
        client.chat("scorer", MESSAGES)
    with pytest.raises(ClientError, match="no server configured for role 'embedder'") as error:
        client.chat("embedder", MESSAGES)
    assert error.value.status == 404
    assert not client.health()  # the scorer's server is down
    healthy = Client.from_url({"generator": url, "planner": url})
    assert healthy.health() and healthy.models() == ["generator"]


def test_accounting_is_thread_safe(flaky) -> None:
    url, _ = flaky
    client = Client.from_url(url)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: client.chat("fast", MESSAGES), range(40)))
    assert {r.text for r in results} == {"ok"} and all(r.latency_s > 0 for r in results)
    stats = client.stats.summary()["fast"]
    assert stats["requests"] == 40 and stats["prompt_tokens"] == 120 and stats["completion_tokens"] == 40
    assert 0 < stats["latency_p50_s"] <= stats["latency_p95_s"] <= stats["latency_total_s"]


def test_a_forks_usage_absorbed_by_its_parent_adds_up() -> None:
    parent = Client.from_url("http://127.0.0.1:1/v1")
    parent.stats.record("generator", 0.5, {"prompt_tokens": 10, "completion_tokens": 2}, retries=0, failed=False)
    fork = parent.fork()
    fork.stats.record("generator", 1.5, {"prompt_tokens": 7, "completion_tokens": 3}, retries=1, failed=True)
    fork.stats.record("scorer", 0.25, None, retries=0, failed=False)
    assert parent.stats.summary()["generator"]["requests"] == 1  # a fork counts apart until absorbed
    parent.stats.absorb(fork.stats)
    summary = parent.stats.summary()
    assert {k: summary["generator"][k] for k in ("requests", "failures", "retries", "prompt_tokens",
                                                 "completion_tokens", "latency_total_s")} == {
        "requests": 2, "failures": 1, "retries": 1, "prompt_tokens": 17, "completion_tokens": 5, "latency_total_s": 2.0}
    assert summary["scorer"]["requests"] == 1 and fork.stats.summary()["generator"]["requests"] == 1
