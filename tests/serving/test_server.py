"""The embedded server through its HTTP interface, with the real SmolLM2 and MiniLM."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from overstory.serving.client import Client, ClientError
from overstory.serving.in_process import in_process_client

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def http(server_url: str):
    with httpx.Client(base_url=server_url, timeout=120) as client:
        yield client


def test_health_and_models(http: httpx.Client) -> None:
    assert http.get("/health").json()["status"] == "ok"
    models = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["generator", "planner", "scorer", "embedder"]
    assert models[0]["root"] == "builtin:smollm2-135m-instruct"


def test_chat_greedy_is_deterministic_and_counts_tokens(http: httpx.Client, engine) -> None:
    request = {"model": "generator", "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    first, second = http.post("/v1/chat/completions", json=request), http.post("/v1/chat/completions", json=request)
    assert first.status_code == 200
    body = first.json()
    text = body["choices"][0]["message"]["content"]
    assert "Paris" in text and text == second.json()["choices"][0]["message"]["content"]
    tokenizer = engine.tokenizer("generator")
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 0 < usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_and_stop_are_honoured(http: httpx.Client) -> None:
    long = [{"role": "user", "content": "Write a long story about a dragon."}]
    body = http.post("/v1/chat/completions", json={"model": "planner", "messages": long, "max_tokens": 5,
                                                   "temperature": 0}).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    full = http.post("/v1/completions", json={"model": "generator", "prompt": "One, two, three, four,",
                                              "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
    cut = http.post("/v1/completions", json={"model": "generator", "prompt": "One, two, three, four,",
                                             "max_tokens": 12, "temperature": 0, "stop": [","]}).json()
    assert "," in full and cut["choices"][0]["text"] == full[: full.index(",")]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_a_list_of_prompts_is_one_batch(http: httpx.Client) -> None:
    body = http.post("/v1/completions", json={"model": "generator", "prompt": ["Paris is", "Rome is"], "n": 2,
                                              "max_tokens": 3, "temperature": 0}).json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # n choices per prompt, prompt by prompt
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    assert body["usage"]["completion_tokens"] == 4 * 3
    empty = http.post("/v1/completions", json={"model": "generator", "prompt": []})
    assert empty.status_code == 400 and "prompt must not be empty" in empty.json()["error"]["message"]


def test_sampling_with_seed_and_n(http: httpx.Client) -> None:
    request = {"model": "generator", "prompt": "My favourite animal is", "max_tokens": 8, "temperature": 1.0,
               "seed": 7, "n": 3}
    first = http.post("/v1/completions", json=request).json()
    again = http.post("/v1/completions", json=request).json()
    assert len(first["choices"]) == 3
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert len({c["text"] for c in first["choices"]}) > 1


def test_embeddings(http: httpx.Client) -> None:
    body = http.post("/v1/embeddings", json={"model": "embedder", "input": [
        "Normandy is a region in France.", "The Normans came from Normandy.", "P versus NP is open."]}).json()
    vectors = np.array([d["embedding"] for d in body["data"]])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    assert body["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("request_kwargs", "status", "reason"), [
    ({"json": {"model": "nope", "messages": QUESTION}}, 404, "not served here"),
    ({"content": b'{"model": "generator", "messages": [', "headers": {"content-type": "application/json"}}, 400,
     "not valid JSON"),
    ({"json": {"model": "generator"}}, 400, "messages: Field required"),
    ({"json": {"model": "generator", "messages": [{"role": "wizard", "content": "hi"}]}}, 400, "role"),
    ({"json": {"model": "generator", "messages": QUESTION, "temperature": -1}}, 400, "temperature"),
    ({"json": {"model": "embedder", "messages": QUESTION}}, 400, "not a chat model"),
    ({"json": {"model": "generator", "messages": [{"role": "user", "content": "word " * 9000}]}}, 400,
     "more than the model's context of 8192"),
])
def test_errors_are_4xx_with_a_reason(http: httpx.Client, request_kwargs: dict, status: int, reason: str) -> None:
    response = http.post("/v1/chat/completions", **request_kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert reason in error["message"] and "Traceback" not in response.text


def test_in_process_backend_matches_http(engine, server_url: str) -> None:
    http_client, local = Client.from_url(server_url), in_process_client(engine)
    for client in (http_client, local):
        assert client.health() and "embedder" in client.models()
    params = {"max_tokens": 12, "temperature": 0}
    assert http_client.chat("scorer", QUESTION, **params).text == local.chat("scorer", QUESTION, **params).text
    np.testing.assert_allclose(http_client.embed("embedder", ["a b c"]), local.embed("embedder", ["a b c"]),
                               atol=1e-6)
    with pytest.raises(ClientError) as error:
        local.chat("nope", QUESTION)
    assert error.value.status == 404
    summary = local.stats.summary()
    assert summary["scorer"]["requests"] == 1 and summary["nope"]["failures"] == 1
