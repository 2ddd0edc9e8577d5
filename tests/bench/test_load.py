"""The bounded mixed load test (bench/load.py) against a stand-in for the model server.

The stand-in is a small FastAPI app that answers the OpenAI routes the load test uses (chat, streamed chat,
completions, embeddings, /v1/rerank, /health) with well-formed bodies and refuses every malformed case with a
4xx in OpenAI's error shape, in milliseconds and without a model, so that the load test's accounting can be
checked exactly. A faulty stand-in then answers one malformed case with 200, one valid kind with 500 and cuts
its streams short: the load test must count each of these as a failure of its kind.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from typing import Any, Literal

import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from overstory.bench.load import (
    DEFAULT_WEIGHTS,
    MALFORMED,
    Planned,
    _body_problem,
    _judged,
    _stream_problem,
    available_kinds,
    mixed_load,
    plan_requests,
)
from overstory.serving.launch import serve_in_background

ROLES = {"generator": "chat", "embedder": "embedding", "scorer": "cross-encoder"}


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error",
                                                               "param": None, "code": status}})


class _Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | None = None


class _Chat(BaseModel):
    model: str
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    n: int = 1  # checked in the handler, so that the faulty stand-in can let n=0 through
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class _Completion(BaseModel):
    model: str
    prompt: str
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0)


class _Embeddings(BaseModel):
    model: str
    input: str | list[str]


class _Rerank(BaseModel):
    model: str
    query: str
    documents: list[str]


def stand_in_model_server(faults: frozenset[str] = frozenset(), health_status: int = 200,
                          delay_s: float = 0.0) -> FastAPI:
    """A stand-in for the model server. ``faults``: "n_zero_accepted" (a malformed case answered 200),
    "embeddings_500" (a valid kind answered 500), "stream_without_done" (streams end without [DONE]),
    "detail_errors" (a 405 answered in FastAPI's {"detail": ...} shape, not OpenAI's).
    ``delay_s``: how long each chat request takes."""
    app = FastAPI()
    served = {"chat": "generator", "embedding": "embedder", "scorer": "scorer"}

    @app.exception_handler(_Refused)
    async def refused(_: Request, exc: _Refused) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, str(exc.errors()[0].get("msg")))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        if "detail_errors" in faults:
            return JSONResponse(status_code=exc.status_code, content={"detail": exc.detail})
        return _error(exc.status_code, str(exc.detail))

    def model(name: str, role: str) -> None:
        if name != served[role]:
            raise _Refused(404, f"model {name!r} is not served here")

    def check_chat(request: _Chat) -> None:
        model(request.model, "chat")
        if request.n < 1 and "n_zero_accepted" not in faults:
            raise _Refused(400, "n must be >= 1")
        for message in request.messages:
            try:
                (message.content or "").encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: valid JSON, not valid Unicode
                raise _Refused(400, "content is not valid Unicode") from None
        if request.stream_options is not None and not request.stream:
            raise _Refused(400, "stream_options needs stream=true")
        if request.top_logprobs is not None and not request.logprobs:
            raise _Refused(400, "top_logprobs needs logprobs=true")
        if request.response_format and request.response_format.get("type") not in ("text", "json_object",
                                                                                    "json_schema"):
            raise _Refused(400, "unknown response_format type")
        if isinstance(request.tool_choice, dict):
            names = {t["function"]["name"] for t in request.tools or []}
            if request.tool_choice["function"]["name"] not in names:
                raise _Refused(400, "tool_choice names a tool that is not among the tools")

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse(status_code=health_status, content={"status": "ok"})

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: _Chat) -> dict[str, Any] | StreamingResponse:
        check_chat(request)
        await asyncio.sleep(delay_s)
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if not request.stream:
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": request.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                                 "finish_reason": "stop"}], "usage": usage}

        def chunk(choices: list[dict], **extra: Any) -> str:
            return "data: " + json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                          "model": request.model, "choices": choices, **extra}) + "\n\n"

        async def events():
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": "Par"}, "finish_reason": None}])
            yield chunk([{"index": 0, "delta": {"content": "is."}, "finish_reason": "stop"}])
            yield chunk([], usage=usage)
            if "stream_without_done" not in faults:
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    def completions(request: _Completion) -> dict[str, Any]:
        model(request.model, "chat")
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": request.model,
                "choices": [{"index": 0, "text": " Paris.", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}

    @app.post("/v1/embeddings")
    def embeddings(request: _Embeddings) -> JSONResponse:
        model(request.model, "embedding")
        if "embeddings_500" in faults:
            return _error(500, "internal error")
        texts = [request.input] if isinstance(request.input, str) else request.input
        return JSONResponse({"object": "list", "model": request.model, "usage": {"prompt_tokens": 3 * len(texts)},
                             "data": [{"object": "embedding", "index": i, "embedding": [0.6, 0.8, 0.0]}
                                      for i in range(len(texts))]})

    @app.post("/v1/rerank")
    def rerank(request: _Rerank) -> dict[str, Any]:
        model(request.model, "scorer")
        scores = [1 / (1 + i) for i in range(len(request.documents))]  # already best first
        return {"id": "score-1", "model": request.model, "usage": {"prompt_tokens": 9, "total_tokens": 9},
                "results": [{"index": i, "document": {"text": d}, "relevance_score": s}
                            for i, (d, s) in enumerate(zip(request.documents, scores))]}

    return app


def test_a_correct_server_passes_with_exact_accounting() -> None:
    with serve_in_background(stand_in_model_server(delay_s=0.02)) as url:
        report = mixed_load(url, ROLES, requests=200, concurrency=8, pids=[os.getpid()], max_tokens=8, seed=3,
                            progress=False)
    by_kind = report["by_kind"]
    assert set(by_kind) == set(DEFAULT_WEIGHTS)  # every kind is served by these roles
    assert sum(k["sent"] for k in by_kind.values()) == report["sent"] == report["requests"] == 200
    assert {kind: k["sent"] for kind, k in by_kind.items()} == {kind: round(200 * w)
                                                                 for kind, w in DEFAULT_WEIGHTS.items()}
    assert all(k["ok"] == k["sent"] and k["failed"] == 0 and k["p95_s"] >= k["p50_s"] > 0 for k in by_kind.values())
    assert report["failed_valid"] == report["malformed_not_4xx"] == report["malformed_bad_error_body"] == 0
    assert report["failures"] == [] and not report["time_limited"]
    # 20 malformed requests go through all the cases, each refused with its expected status
    assert report["malformed_statuses"] == {name: [expect] for name, _, expect, *_ in MALFORMED}
    health = report["health"]
    assert health["probes"] >= 1 and health["answered"] == health["probes"]
    assert report["rss_peak_mib"] >= report["rss_first_quarter_mib"] > 50 and report["rss_samples"] >= 1
    assert report["rss_quarters_mib"][0] <= report["rss_peak_mib"] and len(report["rss_quarters_mib"]) <= 4
    assert report["requests_per_s"] > 0 and report["wall_s"] > 0


def test_wrong_answers_are_failures_of_their_kind() -> None:
    faults = frozenset({"n_zero_accepted", "embeddings_500", "stream_without_done", "detail_errors"})
    with serve_in_background(stand_in_model_server(faults, health_status=503)) as url:
        report = mixed_load(url, ROLES, requests=200, concurrency=8, pids=[os.getpid()], max_tokens=8, seed=3,
                            progress=False)
    by_kind = report["by_kind"]
    # every embeddings and every stream request failed; chat, completions and scoring did not
    assert by_kind["embeddings"]["failed"] == by_kind["embeddings"]["sent"] == 30
    assert by_kind["stream"]["failed"] == by_kind["stream"]["sent"] == 40
    assert by_kind["chat"]["failed"] == by_kind["completions"]["failed"] == by_kind["scoring"]["failed"] == 0
    assert report["failed_valid"] == 70
    # the n=0 case (20 malformed over 17 cases: taken once) answered 200
    assert report["malformed_not_4xx"] == 1 and report["malformed_statuses"]["n_zero"] == [200]
    # the GET on /v1/chat/completions was refused with 405, but not in OpenAI's error shape
    assert report["malformed_bad_error_body"] == 1 and report["malformed_statuses"]["wrong_method"] == [405]
    assert by_kind["malformed"]["failed"] == 2
    failures = report["failures"]
    assert len(failures) == 10 and [f["index"] for f in failures] == sorted(f["index"] for f in failures)
    seen = {(f["kind"], f["case"], f["status"]) for f in failures}
    assert ("embeddings", "embeddings", 500) in seen and ("stream", "stream", 200) in seen
    assert all(f["problem"] and f["body_head"] for f in failures)
    assert any("[DONE]" in f["problem"] for f in failures if f["kind"] == "stream")
    assert report["health"]["probes"] >= 1 and report["health"]["answered"] == 0  # /health answered 503


def test_the_time_limit_stops_the_load() -> None:
    # 60 requests of 0.3 s each on 2 connections take 9 s: a limit of 1 s leaves most of them unsent, uncounted
    with serve_in_background(stand_in_model_server(delay_s=0.3)) as url:
        report = mixed_load(url, {"generator": "chat"}, requests=60, concurrency=2, pids=[os.getpid()],
                            max_tokens=8, time_limit_s=1.0, progress=False)
    assert report["time_limited"] and 0 < report["sent"] < 60 and report["requests"] == 60
    assert report["failed_valid"] == 0 and sum(k["sent"] for k in report["by_kind"].values()) == report["sent"]


def test_the_mix_is_deterministic_and_follows_the_roles() -> None:
    chat_only = {"generator": "chat", "planner": "chat", "scorer": "chat", "embedder": "embedding"}
    assert available_kinds(chat_only) == ["chat", "stream", "completions", "embeddings", "malformed"]
    assert available_kinds({"embedder": "embedding"}) == ["embeddings", "malformed"]
    plan = plan_requests(chat_only, 1000, max_tokens=16, seed=0)
    assert plan == plan_requests(chat_only, 1000, max_tokens=16, seed=0)
    assert [p.body for p in plan] != [p.body for p in plan_requests(chat_only, 1000, max_tokens=16, seed=1)]
    counts = Counter(p.kind for p in plan)
    assert sum(counts.values()) == 1000 and "scoring" not in counts  # a chat scorer gets no /v1/rerank
    assert counts["chat"] == 389 and counts["malformed"] == 111  # 35% and 10% of the 90% left, rounded
    # no case needing a role the server lacks, the rest taken in turn; chat goes to the first chat role
    cases = [p.case for p in plan if p.kind == "malformed"]
    assert "rerank_without_documents" not in cases and cases[:3] == ["bad_json", "missing_messages", "unknown_model"]
    assert all(json.loads(p.body)["model"] == "generator" for p in plan if p.kind == "chat")
    with pytest.raises(ValueError, match="unknown request kinds"):
        plan_requests(chat_only, 10, max_tokens=4, weights={"chat": 1, "images": 1})


def _sse(*payloads: dict | str) -> list[str]:
    lines = []
    for payload in payloads:
        lines += [f"data: {payload if isinstance(payload, str) else json.dumps(payload)}", ""]
    return lines


def test_the_body_checks_name_what_is_wrong() -> None:
    first = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"},
                                                             "finish_reason": "stop"}]}
    usage = {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert _stream_problem([": keep-alive", *_sse(first, usage, "[DONE]")]) is None
    assert "usage" in _stream_problem(_sse(first, "[DONE]"))
    assert "error" in _stream_problem(_sse(first, {"error": {"message": "boom", "type": "server_error"}}, "[DONE]"))
    assert "not JSON" in _stream_problem(_sse(first, "{oops", usage, "[DONE]"))
    assert "[DONE]" in _stream_problem(_sse(first, "[DONE]", usage, "[DONE]"))
    assert "finish_reason" in _stream_problem(_sse({**first, "choices": [{"index": 0, "delta": {}}]}, usage, "[DONE]"))
    scoring = Planned(0, "scoring", "scoring", "POST", "/v1/rerank", b"", n_inputs=2)
    unsorted = {"results": [{"index": 0, "relevance_score": 0.1}, {"index": 1, "relevance_score": 0.9}]}
    assert "sorted" in _body_problem(scoring, unsorted)
    assert "as many" in _body_problem(scoring, {"results": unsorted["results"][:1]})
    chat = Planned(0, "chat", "chat", "POST", "/v1/chat/completions", b"")
    assert "unexpected shape" in _judged(_body_problem, chat, {"object": "chat.completion", "choices": ["Paris"]})
