"""Malformed and unusual requests against the embedded server: each gets a proper answer or a 4xx in OpenAI's
error shape that names the problem, never a 500; a client that leaves mid-stream frees its batch slot."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
HELLO = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def chat(**fields) -> dict:
    return {"model": "generator", "messages": HELLO, "max_tokens": 4, "temperature": 0, **fields}


# (name, method, path, JSON body or raw bytes, expected status, a word the error message must contain)
HOSTILE = [
    ("not json", "POST", CHAT, b"{not json", 400, "not valid JSON"),
    ("empty body", "POST", CHAT, b"", 400, ""),
    ("body is a list", "POST", CHAT, [1, 2], 400, ""),
    ("no messages", "POST", CHAT, {"model": "generator"}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"model": "generator", "messages": []}, 400, "messages"),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), 404, "not served"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("content is a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 7}]), 400, "content"),
    ("image part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "content"),
    # JSON escapes a client can send but that are no Unicode text (httpx itself refuses to encode the string)
    ("lone surrogate and NUL", "POST", CHAT,
     b'{"model": "generator", "messages": [{"role": "user", "content": "a\\ud800b\\u0000c"}]}', 400, "Unicode"),
    ("negative max_tokens", "POST", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("n = 0", "POST", CHAT, chat(n=0), 400, "n"),
    ("temperature 5", "POST", CHAT, chat(temperature=5), 400, "temperature"),
    ("top_p 0", "POST", CHAT, chat(top_p=0), 400, "top_p"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("huge prompt", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 9000}]), 400, "context"),
    ("unknown response_format", "POST", CHAT, chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("schema missing", "POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     400, "schema"),
    ("invalid JSON schema", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": "a"}}}),
     400, "required"),
    ("tool_choice names a missing tool", "POST", CHAT,
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}), 400, "other"),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400, "tool"),
    ("tool message without a call", "POST", CHAT,
     chat(messages=[*HELLO, {"role": "tool", "tool_call_id": "call_1", "content": "42"}]), 400, "call_1"),
    ("stream_options without stream", "POST", CHAT, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream with logprobs", "POST", CHAT, chat(stream=True, logprobs=True), 400, "logprobs"),
    ("echo", "POST", COMPLETIONS, {"model": "generator", "prompt": "x", "echo": True}, 400, "echo"),
    ("made-up field", "POST", CHAT, chat(temprature=0.5), 400, "Unrecognized request argument supplied: temprature"),
    ("best_of", "POST", COMPLETIONS, {"model": "generator", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ("logit_bias key", "POST", CHAT, chat(logit_bias={"banana": 5}), 400, "logit_bias"),
    ("top_k below -1", "POST", CHAT, chat(top_k=-2), 400, "top_k"),
    ("empty prompt", "POST", COMPLETIONS, {"model": "generator", "prompt": ""}, 400, "empty"),
    ("token id out of range", "POST", COMPLETIONS, {"model": "generator", "prompt": [1, 99999999]}, 400, "token"),
    ("mixed prompt list", "POST", COMPLETIONS, {"model": "generator", "prompt": ["a", 3]}, 400, "prompt"),
    ("chat on the embedder", "POST", CHAT, chat(model="embedder"), 400, "not a chat"),
    ("embeddings of a chat model", "POST", EMBEDDINGS, {"model": "generator", "input": "x"}, 400, "embedding"),
    ("GET on chat", "GET", CHAT, None, 405, "GET"),
    ("unknown path", "POST", "/v1/nothing", {}, 404, "/v1/nothing"),
]


@pytest.fixture(scope="module")
def http(server_url: str):
    with httpx.Client(base_url=server_url, timeout=300) as client:
        yield client


@pytest.mark.parametrize("name,method,path,body,status,word", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_request_gets_a_clear_4xx(http: httpx.Client, name, method, path, body, status, word) -> None:
    if isinstance(body, bytes):
        response = http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and word.lower() in error["message"].lower()


@pytest.mark.parametrize("body", [
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}]}]),
    chat(messages=[{"role": "developer", "content": "Be brief."}, *HELLO]),
    chat(messages=[{"role": "user", "content": "\u0000 nul, emoji \U0001f600 and accents \u00e9"}]),
    chat(stop="x", seed=3, temperature=0.7, top_p=0.9, user="someone", parallel_tool_calls=False),
    chat(seed=3, temperature=0.7, top_k=5, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5,
         repetition_penalty=1.2, logit_bias={"0": -100}, metadata={"k": "v"}, store=False),
])
def test_unusual_but_valid_requests_are_answered(http: httpx.Client, body: dict) -> None:
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["choices"][0]["message"]["content"], str)


def test_streamed_n_2_interleaves_both_choices(http: httpx.Client) -> None:
    events = []
    with http.stream("POST", CHAT, json=chat(n=2, temperature=0.9, seed=1, max_tokens=6, stream=True)) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    assert finished.keys() == {0, 1}


def test_a_client_that_leaves_mid_stream_stops_its_generation(http: httpx.Client, engine) -> None:
    batcher = engine._models["generator"].batcher
    request = chat(max_tokens=2000, stream=True, messages=[{"role": "user", "content": "Tell a very long story."}])
    with http.stream("POST", CHAT, json=request) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break  # one token arrived: leave
    deadline = time.monotonic() + 60
    while batcher.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert batcher.running == 0  # the row was cancelled long before 2000 tokens
    follow = http.post(CHAT, json=chat(max_tokens=4)).json()  # and the slot serves the next request
    assert follow["usage"]["completion_tokens"] <= 4
