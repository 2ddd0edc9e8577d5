"""A stand-in for vLLM's OpenAI server (not vLLM): it answers as vLLM does, with role names as model names,
server-sent events, OpenAI error bodies and a Prometheus page of vLLM's token counter, and records what reached it.
The front door's tests put it behind the door; the runbook's tests read its counters through one."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclasses.dataclass
class StandIn:
    """What a stand-in server saw, and the switches a test turns."""

    name: str
    requests: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    gate: threading.Event = dataclasses.field(default_factory=threading.Event)  # releases a stream's 2nd chunk
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # a stream sent its last chunk
    closed: threading.Event = dataclasses.field(default_factory=threading.Event)  # a stream ended, either way
    healthy: bool = True
    prompt_tokens: int = 0  # what its /metrics says it has read

    def reset(self) -> None:
        self.requests.clear()
        for event in (self.gate, self.finished, self.closed):
            event.clear()
        self.healthy = True
        self.prompt_tokens = 0


def sse_chunk(model: str, text: str) -> bytes:
    body = {"object": "chat.completion.chunk", "model": model, "choices": [{"index": 0, "delta": {"content": text}}]}
    return f"data: {json.dumps(body)}\n\n".encode()


def vllm_stand_in(state: StandIn, models: list[str], api_key: str | None = None) -> FastAPI:
    """A stand-in for a vLLM OpenAI server serving ``models`` (plus a base model name, as a LoRA server lists)."""
    app = FastAPI()

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse({}, status_code=200 if state.healthy else 500)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        """vLLM's counters by its first served name, and a process sample every server has."""
        if not state.healthy:
            return PlainTextResponse("Internal Server Error", status_code=500)
        return PlainTextResponse(
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
            "# TYPE vllm:prompt_tokens_total counter\n"
            f'vllm:prompt_tokens_total{{engine="0",model_name="{models[0]}"}} {state.prompt_tokens}.0\n'
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
            "# TYPE process_cpu_seconds_total counter\n"
            "process_cpu_seconds_total 1.5\n")

    @app.get("/v1/models")
    def list_models(request: Request) -> JSONResponse:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "vllm"}
                                                        for m in [*models, f"{models[0]}-base"]]})

    @app.post("/{path:path}")
    async def inference(path: str, request: Request):
        body = await request.body()
        state.requests.append({"path": request.url.path, "query": request.url.query, "body": body,
                               "headers": dict(request.headers)})
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        payload = json.loads(body)
        if payload.get("messages", [{}])[0].get("content") == "fail":
            return JSONResponse(status_code=400, content={"error": {
                "message": "This model's maximum context length is 2048 tokens.", "type": "BadRequestError",
                "param": None, "code": 400}})
        if payload.get("stream"):
            return StreamingResponse(events(payload["model"]), media_type="text/event-stream")
        return {"model": payload["model"], "served_by": state.name, "path": request.url.path,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"from {state.name}"},
                             "finish_reason": "stop"}]}

    async def events(model: str):
        try:
            yield sse_chunk(model, "Hel")
            deadline = time.monotonic() + 20
            while not state.gate.is_set():  # the test lets the rest through once it has the first chunk
                if time.monotonic() > deadline:
                    break
                await anyio.sleep(0.01)
            yield sse_chunk(model, "lo")
            yield b"data: [DONE]\n\n"
            state.finished.set()
        finally:  # also when the stream is cancelled because the client went away
            state.closed.set()

    return app
