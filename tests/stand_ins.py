"""Stand-ins the suite shares, each for what a real component cannot be made to do on demand."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse


def failing_server(status: int, message: str) -> FastAPI:
    """Stand-in for a stack that lists its models (generator and embedder, both ``model-x``) and answers every chat
    request with ``status``: a real server cannot be made to fail every request of a healthy job, and the job's
    failure path is what is under test (a 400: refused for good; a 503: overloaded, a transient failure)."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": role, "object": "model", "root": "model-x"}
                                           for role in ("generator", "embedder")]}

    @app.post("/v1/chat/completions")
    def chat() -> JSONResponse:
        return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}})

    return app
