"""The front door of an ``engine: vllm`` stack (serving/front_door.py): every role on one base URL.

Most tests put the front door over small FastAPI apps served on loopback: stand-ins for vLLM's OpenAI
servers (tests/serving/vllm_stand_in.py: not vLLM, they answer as vLLM does and record what reached them) and a
stand-in for the embedded server. The last test (marked
``vllm``) takes the package's cpu-vllm stack (conftest.py, ``serving.launch.vllm_stack``) and drives it with
the official ``openai`` package on one base URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client.parser import text_string_to_metric_families

from overstory.serving.client import Client
from overstory.serving.front_door import REQUEST_MODELS, create_front_app, mount_front_door
from overstory.serving.launch import serve_in_background
from overstory.serving.ports import free_port
from tests.serving.vllm_stand_in import StandIn, sse_chunk, vllm_stand_in

ROOT = Path(__file__).resolve().parents[2]


def embedded_stand_in() -> FastAPI:
    """A stand-in for the embedded server: the embedder, and OpenAI's 404 for a model it does not serve."""
    app = FastAPI()

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "roles": ["embedder"]}

    @app.get("/v1/models")
    def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "embedder", "object": "model", "owned_by": "overstory"}]}

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse("# HELP overstory:prompt_tokens_total Prompt (input) tokens processed.\n"
                                 "# TYPE overstory:prompt_tokens_total counter\n"
                                 'overstory:prompt_tokens_total{model_name="embedder"} 3.0\n')

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"served_by": "embedded", "echo": body}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        model = (await request.json())["model"]
        return JSONResponse(status_code=404, content={"error": {
            "message": f"unknown model {model!r}", "type": "model_not_found", "param": "model", "code": 404}})

    return app


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    """Two vLLM stand-ins (generator and planner on one, scorer on the other) behind the embedded stand-in."""
    a, b = StandIn("a"), StandIn("b")
    with serve_in_background(vllm_stand_in(a, ["generator", "planner"])) as url_a, \
            serve_in_background(vllm_stand_in(b, ["scorer"])) as url_b:
        upstreams = {"generator": url_a, "planner": f"{url_a}/v1", "scorer": url_b}
        door = partial(mount_front_door, upstreams=upstreams, timeout_s=30,
                       dtypes={"generator": "bfloat16", "planner": "bfloat16", "scorer": "float32"})
        with serve_in_background(embedded_stand_in(), configure_app=door) as front:  # /health must answer 200
            yield {"front": front, "a": a, "b": b, "url_a": url_a, "url_b": url_b}


@pytest.fixture
def stack(servers: dict[str, Any]) -> dict[str, Any]:
    servers["a"].reset()
    servers["b"].reset()
    return servers


def _chat(model: str, content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def test_each_model_goes_to_the_server_that_serves_it(stack: dict[str, Any]) -> None:
    front, a, b = stack["front"], stack["a"], stack["b"]
    body = json.dumps(_chat("generator", max_tokens=4)).encode()
    reply = httpx.post(f"{front}/v1/chat/completions?trace=1", content=body,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json()["served_by"] == "a"
    seen = a.requests[-1]
    # forwarded as it came: same path, query, bytes; the upstream's own Host, no key (none is set)
    assert (seen["path"], seen["query"], seen["body"]) == ("/v1/chat/completions", "trace=1", body)
    assert seen["headers"]["host"] == stack["url_a"].removeprefix("http://") and "authorization" not in seen["headers"]
    assert httpx.post(f"{front}/v1/chat/completions", json=_chat("planner")).json()["served_by"] == "a"
    assert httpx.post(f"{front}/v1/chat/completions", json=_chat("scorer")).json()["served_by"] == "b"
    completion = httpx.post(f"{front}/v1/completions", json={"model": "generator", "prompt": "Hi"}).json()
    assert (completion["served_by"], completion["path"]) == ("a", "/v1/completions")
    tokenized = httpx.post(f"{front}/tokenize", json={"model": "scorer", "prompt": "Hi"}).json()
    assert (tokenized["served_by"], tokenized["path"]) == ("b", "/tokenize")
    assert len(a.requests) == 3 and len(b.requests) == 2

    # not a proxied role: the embedded app gets the request, body included (the door read it to peek)
    embedded = httpx.post(f"{front}/v1/embeddings", json={"model": "embedder", "input": ["x", "y"]}).json()
    assert embedded == {"served_by": "embedded", "echo": {"model": "embedder", "input": ["x", "y"]}}
    unknown = httpx.post(f"{front}/v1/chat/completions", json=_chat("writer"))
    assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "unknown model 'writer'"
    assert len(a.requests) + len(b.requests) == 5


def test_a_stream_is_passed_on_chunk_by_chunk(stack: dict[str, Any]) -> None:
    front, a = stack["front"], stack["a"]
    with httpx.stream("POST", f"{front}/v1/chat/completions", json=_chat("generator", stream=True),
                      timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = response.iter_raw()
        first = next(chunks)
        # the upstream is still holding its second chunk back: a buffering proxy would have sent nothing yet
        assert first == sse_chunk("generator", "Hel") and not a.finished.is_set()
        a.gate.set()
        rest = b"".join(chunks)
    assert rest == sse_chunk("generator", "lo") + b"data: [DONE]\n\n" and a.finished.is_set()


def test_a_client_that_goes_away_closes_the_upstream_stream(stack: dict[str, Any]) -> None:
    front, a = stack["front"], stack["a"]
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{front}/v1/chat/completions",
                                                           json=_chat("generator", stream=True)) as response:
        assert next(response.iter_raw()) == sse_chunk("generator", "Hel")
    # the client hung up mid-stream; the upstream's generator must be stopped, not left to run to its end
    assert a.closed.wait(10) and not a.finished.is_set()


def test_upstream_errors_keep_their_status_and_body(stack: dict[str, Any]) -> None:
    reply = httpx.post(f"{stack['front']}/v1/chat/completions", json=_chat("generator", "fail"))
    assert reply.status_code == 400
    assert reply.json() == {"error": {"message": "This model's maximum context length is 2048 tokens.",
                                      "type": "BadRequestError", "param": None, "code": 400}}


def test_models_lists_every_role_and_health_asks_every_server(stack: dict[str, Any]) -> None:
    front, b = stack["front"], stack["b"]
    models = httpx.get(f"{front}/v1/models").json()
    # the base model name a LoRA server also lists is not a role: left out
    assert [m["id"] for m in models["data"]] == ["embedder", "generator", "planner", "scorer"]
    # each upstream role with the dtype its server was started with (vLLM does not list it); the embedded
    # app's entries as that app lists them
    assert [m.get("dtype") for m in models["data"]] == [None, "bfloat16", "bfloat16", "float32"]
    health = httpx.get(f"{front}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()["roles"]) == {"embedder", "generator", "planner", "scorer"}
    b.healthy = False
    health = httpx.get(f"{front}/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert health.json()["upstreams"] == {stack["url_a"]: "ok", stack["url_b"]: "status 500"}


def test_metrics_is_the_whole_stacks_page(stack: dict[str, Any]) -> None:
    """Every server's samples on the door's /metrics, upstream ones labelled with their server, the roles of each
    named, so a client behind the door reads vLLM's token counters (summed over the roles vLLM counts as one)."""
    stack["a"].prompt_tokens, stack["b"].prompt_tokens = 12, 5
    page = httpx.get(f"{stack['front']}/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    samples = [s for family in text_string_to_metric_families(page.text) for s in family.samples]
    servers = {s.labels.get("server") for s in samples if s.name == "vllm:prompt_tokens_total"}
    assert servers == {stack["url_a"], stack["url_b"]}
    assert len([s for s in samples if s.name == "process_cpu_seconds_total"]) == 2  # kept apart by server
    roles = {(s.labels["server"], s.labels["role"]) for s in samples if s.name == "overstory:upstream_role_info"}
    assert roles == {(stack["url_a"], "generator"), (stack["url_a"], "planner"), (stack["url_b"], "scorer")}
    assert Client.from_url(stack["front"]).server_token_totals() == {
        "generator+planner": {"prompt_tokens": 12, "completion_tokens": 0},
        "scorer": {"prompt_tokens": 5, "completion_tokens": 0},
        "embedder": {"prompt_tokens": 3, "completion_tokens": 0}}
    openmetrics = httpx.get(f"{stack['front']}/metrics", headers={"accept": "application/openmetrics-text"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    stack["b"].healthy = False  # a page without b's counters would say b did nothing
    broken = httpx.get(f"{stack['front']}/metrics")
    assert broken.status_code == 502 and stack["url_b"] in broken.json()["error"]["message"]


def test_an_unreachable_upstream_is_a_502_in_openai_shape() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = embedded_stand_in()
    mount_front_door(app, {"generator": dead}, timeout_s=30)
    with serve_in_background(app) as front:
        reply = httpx.post(f"{front}/v1/chat/completions", json=_chat("generator"))
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert error["type"] == "server_error" and error["code"] == 502 and dead in error["message"]
        health = httpx.get(f"{front}/health")
        assert health.status_code == 503 and "ConnectError" in health.json()["upstreams"][dead]
        assert httpx.get(f"{front}/v1/models").status_code == 502  # a partial list would hide a missing role
        # the embedded roles are still served
        assert httpx.post(f"{front}/v1/embeddings", json={"model": "embedder", "input": "x"}).status_code == 200


def test_the_key_is_checked_at_the_door_and_sent_upstream() -> None:
    state = StandIn("a")
    with serve_in_background(vllm_stand_in(state, ["generator"], api_key="sekret")) as upstream:
        app = create_front_app()  # a stack whose every role is on vLLM: the door has no embedded roles
        mount_front_door(app, {"generator": upstream}, timeout_s=30, api_key="sekret")
        with serve_in_background(app) as front:
            for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"}):
                refused = httpx.post(f"{front}/v1/chat/completions", json=_chat("generator"), headers=headers)
                assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_request_error"
                assert httpx.get(f"{front}/v1/models", headers=headers).status_code == 401
            assert state.requests == []  # refused at the door, never relayed with the stack's key
            key = {"authorization": "bearer sekret"}  # the scheme is case-insensitive, as in vLLM
            assert httpx.post(f"{front}/v1/chat/completions", json=_chat("generator"), headers=key).status_code == 200
            assert state.requests[-1]["headers"]["authorization"] == "Bearer sekret"
            assert [m["id"] for m in httpx.get(f"{front}/v1/models", headers=key).json()["data"]] == ["generator"]
            assert httpx.get(f"{front}/health").status_code == 200  # health needs no key, as on vLLM
            page = httpx.get(f"{front}/metrics")  # nor metrics; a door with no page of its own has its upstream's
            assert page.status_code == 200 and f'server="{upstream}"' in page.text
            unknown = httpx.post(f"{front}/v1/chat/completions", json=_chat("writer"), headers=key)
            assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"


def test_a_field_in_neither_schema_is_refused_at_the_door(stack: dict[str, Any]) -> None:
    front, a, b = stack["front"], stack["a"], stack["b"]
    made_up = httpx.post(f"{front}/v1/chat/completions", json=_chat("generator", temprature=0.5, foo=1))
    assert made_up.status_code == 400
    assert made_up.json() == {"error": {"message": "Unrecognized request arguments supplied: temprature, foo",
                                        "type": "invalid_request_error", "param": "temprature", "code": 400}}
    nested = httpx.post(f"{front}/v1/chat/completions",
                        json=_chat("generator", stream=True, stream_options={"include_usage": True, "x": 1}))
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "stream_options.x"
    for path, body in (("/v1/completions", {"model": "generator", "prompt": "Hi", "bogus": 1}),
                       ("/tokenize", {"model": "scorer", "prompt": "Hi", "bogus": 1}),
                       ("/v1/rerank", {"model": "scorer", "query": "q", "documents": ["d"], "bogus": 1})):
        refused = httpx.post(f"{front}{path}", json=body)
        assert refused.status_code == 400, path
        assert refused.json()["error"]["message"] == "Unrecognized request argument supplied: bogus", path
    # vLLM ignores the guided decoding fields it removed: refused with the embedded server's pointer
    guided = httpx.post(f"{front}/v1/chat/completions", json=_chat("generator", guided_json={"type": "object"}))
    assert guided.status_code == 400 and guided.json()["error"]["param"] == "guided_json"
    assert "response_format" in guided.json()["error"]["message"]
    assert a.requests == [] and b.requests == []  # none of them reached vLLM


def test_every_field_of_either_schema_is_passed_on(stack: dict[str, Any]) -> None:
    front, a = stack["front"], stack["a"]
    # vLLM's sampling extras (the embedded engine refuses some of them; vLLM honours them), OpenAI's labels
    extras = {"top_k": 1, "use_beam_search": False, "repetition_penalty": 1.1, "min_tokens": 2, "priority": 0,
              "structured_outputs": {"choice": ["a", "b"]}, "user": "u1", "metadata": {"k": "v"},
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body = json.dumps(_chat("generator", **extras)).encode()
    reply = httpx.post(f"{front}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 200 and a.requests[-1]["body"] == body
    completion = {"model": "generator", "prompt": [1, 2, 3], "best_of": 2, "echo": True, "min_p": 0.1}
    assert httpx.post(f"{front}/v1/completions", json=completion).status_code == 200
    assert json.loads(a.requests[-1]["body"]) == completion
    # the Responses API has its own fields (no chat schema applies to it): the door holds no model of it
    responses = {"model": "generator", "input": "Hi", "instructions": "Be brief", "max_output_tokens": 8}
    assert httpx.post(f"{front}/v1/responses", json=responses).status_code == 200
    assert json.loads(a.requests[-1]["body"]) == responses and len(a.requests) == 3


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("OVERSTORY_VLLM_PYTHON"), reason="no vLLM environment (OVERSTORY_VLLM_PYTHON)")
def test_the_door_knows_every_field_of_the_installed_vllms_schemas() -> None:
    """The door's schemas are the embedded server's request models: each must hold every field (and alias) of
    the installed vLLM's request model for its path, else the door would refuse a field vLLM supports."""
    fields = json.loads(subprocess.run([os.environ["OVERSTORY_VLLM_PYTHON"], "-c", VLLM_FIELDS], check=True,
                                       capture_output=True, text=True, timeout=600).stdout.splitlines()[-1])
    assert set(fields) == set(VLLM_MODELS)
    for name, path in VLLM_MODELS.items():
        assert fields[name], name
        assert set(fields[name]) <= set(REQUEST_MODELS[path].model_fields), name


# vLLM's request model (module, class) -> the path the door checks it on
VLLM_MODELS = {
    "openai.chat_completion.protocol.ChatCompletionRequest": "/v1/chat/completions",
    "openai.completion.protocol.CompletionRequest": "/v1/completions",
    "pooling.embed.protocol.EmbeddingCompletionRequest": "/v1/embeddings",
    "pooling.embed.protocol.EmbeddingChatRequest": "/v1/embeddings",
    "serve.tokenize.protocol.TokenizeCompletionRequest": "/tokenize",
    "serve.tokenize.protocol.TokenizeChatRequest": "/tokenize",
    "serve.tokenize.protocol.DetokenizeRequest": "/detokenize",
    "pooling.scoring.protocol.ScoreQueriesDocumentsRequest": "/score",
    "pooling.scoring.protocol.ScoreQueriesItemsRequest": "/score",
    "pooling.scoring.protocol.ScoreDataRequest": "/score",
    "pooling.scoring.protocol.ScoreTextRequest": "/score",
    "pooling.scoring.protocol.RerankRequest": "/rerank",
}
VLLM_FIELDS = f"""
import importlib, json
fields = {{}}
for name in {list(VLLM_MODELS)!r}:
    module, _, cls = name.rpartition(".")
    model = getattr(importlib.import_module("vllm.entrypoints." + module), cls)
    fields[name] = sorted({{n for n, f in model.model_fields.items() for n in (n, f.alias) if n}})
print(json.dumps(fields))
"""


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.vllm
def test_the_cpu_vllm_stack_answers_the_openai_package_on_one_base_url(cpu_vllm_stack) -> None:
    """configs/serve/cpu-vllm.yaml's stack (the package's, conftest.py: its vLLM flags, free ports, an API key) on
    one base URL, driven by the official openai package."""
    import openai
    from transformers import AutoTokenizer

    from overstory.models.registry import resolve
    from overstory.serving.tools import render_chat_prompt

    stack, config = cpu_vllm_stack
    key = config.api_key
    chat_port = config.roles["generator"].port
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    assert stack.roles["generator"] == f"http://127.0.0.1:{chat_port}" != stack.url == stack.roles["embedder"]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=300)
    assert {m.id for m in client.models.list()} == {"generator", "scorer", "planner", "embedder"}

    reply = client.chat.completions.create(model="generator", messages=question, max_tokens=16, temperature=0)
    assert reply.model == "generator" and "Paris" in reply.choices[0].message.content
    planned = client.chat.completions.create(model="planner", messages=question, max_tokens=4, temperature=0)
    assert planned.model == "planner" and planned.usage.completion_tokens > 0  # the LoRA module, same base URL

    stream = client.chat.completions.create(model="generator", messages=question, max_tokens=16, temperature=0,
                                            stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == reply.choices[0].message.content

    ask = [{"role": "user", "content": "What is the weather in Paris? Call the tool."}]
    called = client.chat.completions.create(model="generator", messages=ask, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=64, temperature=0)
    choice = called.choices[0]
    assert choice.message.tool_calls or choice.message.content  # the 135M model may answer in words
    for call in choice.message.tool_calls or []:  # whatever the hermes parser returns is a well-formed call
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        assert isinstance(json.loads(call.function.arguments), dict) and choice.finish_reason == "tool_calls"
    # vLLM renders the tools as the embedded engine does: the same prompt tokens for the same request
    tokenizer = AutoTokenizer.from_pretrained(resolve(config.roles["generator"].model))
    tokens = httpx.post(f"{stack.url}/tokenize", json={"model": "generator", "messages": ask, "tools": [WEATHER]},
                        headers={"authorization": f"Bearer {key}"}, timeout=60).json()["tokens"]
    expected = render_chat_prompt(tokenizer, ask, [WEATHER], "auto")
    assert tokens == tokenizer(expected, add_special_tokens=False)["input_ids"]

    embedded = client.embeddings.create(model="embedder", input=["a cat", "a dog"])
    assert len(embedded.data) == 2 and len(embedded.data[0].embedding) == 384

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="generator", messages=question, max_tokens=1)
    # the vLLM server itself was started with the key
    direct = httpx.post(f"{stack.roles['generator']}/v1/chat/completions", timeout=60,
                        json={"model": "generator", "messages": question, "max_tokens": 1})
    assert direct.status_code == 401


@pytest.mark.vllm
def test_a_client_behind_the_door_sees_its_tokens_on_the_servers_counters(cpu_vllm_stack) -> None:
    """The evaluation harness's cost check on the stack's one base URL: the tokens the calls reported equal the
    change in vLLM's and the embedded server's own counters read through the door, the planner (a LoRA module)
    and the scorer counted with the generator, as vLLM counts a server's names."""
    from overstory.evaluation.pipeline import costs_add_up

    stack, config = cpu_vllm_stack
    client = Client.from_url(stack.url, api_key=config.api_key, max_retries=0)
    before = client.server_token_totals()
    question = [{"role": "user", "content": "Name a colour."}]
    for role in ("generator", "planner"):
        assert client.chat(role, question, max_tokens=4, temperature=0).usage["completion_tokens"] > 0
    client.embed("embedder", ["a colour"])
    ours = {role: {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens}
            for role, s in client.stats.roles.items()}
    deadline = time.monotonic() + 10  # vLLM updates its counters beside the reply: give it a moment
    while not (check := costs_add_up(ours, before, client.server_token_totals()))["match"]:
        assert time.monotonic() < deadline, check
        time.sleep(0.2)
    assert set(check["server"]) == {"generator+planner+scorer", "embedder"}


def _chat_requests_seen(vllm_url: str, key: str) -> float:
    """How many chat completion requests the vLLM server has answered, by its Prometheus counter."""
    metrics = httpx.get(f"{vllm_url}/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("http_requests_total{") and 'handler="/v1/chat/completions"' in line)


@pytest.mark.vllm
def test_the_openai_packages_extra_body_reaches_vllm_only_with_fields_of_its_schema(cpu_vllm_stack) -> None:
    """The official client's ``extra_body`` on the stack's one base URL: a made-up name is refused at the door
    (vLLM itself would answer and ignore it), vLLM's own fields reach vLLM and take effect."""
    import openai

    stack, config = cpu_vllm_stack
    key = config.api_key
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=300)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    before = _chat_requests_seen(stack.roles["generator"], key)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="generator", messages=question, max_tokens=4,
                                       extra_body={"temprature": 0})
    assert refused.value.status_code == 400
    assert refused.value.body == {"message": "Unrecognized request argument supplied: temprature",
                                  "type": "invalid_request_error", "param": "temprature", "code": 400}
    assert _chat_requests_seen(stack.roles["generator"], key) == before  # it never reached vLLM
    # without the door, vLLM answers the same body and drops the name
    direct = httpx.post(f"{stack.roles['generator']}/v1/chat/completions", timeout=300,
                        headers={"authorization": f"Bearer {key}"},
                        json={"model": "generator", "messages": question, "max_tokens": 4, "temprature": 0})
    assert direct.status_code == 200

    # vLLM's top_k (not in OpenAI's schema) goes through and takes effect: top_k=1 samples the greedy reply
    greedy = client.chat.completions.create(model="generator", messages=question, max_tokens=8, temperature=0)
    top_1 = client.chat.completions.create(model="generator", messages=question, max_tokens=8, temperature=1.0,
                                           extra_body={"top_k": 1, "repetition_penalty": 1.0})
    assert top_1.choices[0].message.content == greedy.choices[0].message.content
    assert _chat_requests_seen(stack.roles["generator"], key) == before + 3
