"""The client's retries, backoff and timeouts against a server that fails on purpose (no model needed)."""

from __future__ import annotations

import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from serving.client import Client, ClientError
from serving.launch import _claim_port

CHAT_REPLY = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def flaky_app(calls: dict[str, int]) -> FastAPI:
    """/v1/chat/completions behaves by model name: 'flaky-N' fails N times with 503, 'down' always 503,
    'slow' sleeps past the client timeout, 'bad' answers 400."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    def chat(body: dict):
        model = body["model"]
        calls[model] = calls.get(model, 0) + 1
        if model.startswith("flaky-") and calls[model] <= int(model.split("-")[1]):
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if model == "down":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if model == "slow":
            time.sleep(1.0)
        if model == "bad":
            return JSONResponse({"error": {"message": "bad request, do not retry"}}, status_code=400)
        return CHAT_REPLY

    return app


@pytest.fixture(scope="module")
def flaky():
    calls: dict[str, int] = {}
    port = _claim_port("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(flaky_app(calls), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", calls
    server.should_exit = True
    thread.join(10)


MESSAGES = [{"role": "user", "content": "hi"}]


def test_retries_until_success(flaky) -> None:
    url, calls = flaky
    client = Client.from_url(url, max_retries=3, backoff_s=0.01)
    assert client.chat("flaky-2", MESSAGES).text == "ok"
    assert calls["flaky-2"] == 3
    stats = client.stats.summary()["flaky-2"]
    assert stats["retries"] == 2 and stats["failures"] == 0 and stats["completion_tokens"] == 1


def test_gives_up_after_max_retries(flaky) -> None:
    url, calls = flaky
    client = Client.from_url(url, max_retries=2, backoff_s=0.01)
    with pytest.raises(ClientError) as error:
        client.chat("down", MESSAGES)
    assert error.value.status == 503 and "overloaded" in error.value.reason
    assert calls["down"] == 3 and client.stats.summary()["down"]["failures"] == 1


def test_client_errors_are_not_retried(flaky) -> None:
    url, calls = flaky
    with pytest.raises(ClientError) as error:
        Client.from_url(url, max_retries=3, backoff_s=0.01).chat("bad", MESSAGES)
    assert error.value.status == 400 and calls["bad"] == 1


def test_timeouts_are_retried_then_fail(flaky) -> None:
    url, calls = flaky
    client = Client.from_url(url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
    started = time.perf_counter()
    with pytest.raises(ClientError) as error:
        client.chat("slow", MESSAGES)
    assert error.value.status == 0 and "Timeout" in error.value.reason
    assert calls["slow"] == 2 and time.perf_counter() - started < 5


def test_connection_refused_is_bounded() -> None:
    port = _claim_port("127.0.0.1", 0)  # free, nobody listens
    client = Client.from_url(f"http://127.0.0.1:{port}/v1", max_retries=2, backoff_s=0.01)
    with pytest.raises(ClientError, match="ConnectError"):
        client.chat("generator", MESSAGES)
    assert not client.health()
