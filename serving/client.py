"""The one client the rest of overstory uses to reach served models, over HTTP or in-process.

``Client.from_url(url)`` talks to any OpenAI-compatible server (the embedded one, vLLM) with
timeouts and bounded retries (exponential backoff with jitter on connection errors, timeouts,
429 and 5xx; other 4xx fail at once with the server's reason). ``Client.in_process(engine)``
calls an ``EmbeddedEngine`` directly through the same request handlers as the server, for tests
and single-process jobs. Both record requests, failures, retries, tokens and latency per role.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
import numpy as np
from pydantic import ValidationError

from serving import server
from serving.engine import EmbeddedEngine


class ClientError(RuntimeError):
    """A request failed for good; ``status`` is the HTTP status (0 for a transport failure)."""

    def __init__(self, status: int, reason: str):
        super().__init__(f"{status or 'transport error'}: {reason}")
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str
    usage: dict[str, int]
    latency_s: float
    raw: dict[str, Any] = field(repr=False)


@dataclass
class RoleStats:
    requests: int = 0
    failures: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)


class UsageStats:
    """Thread-safe per-role accounting."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.roles: dict[str, RoleStats] = {}

    def record(self, role: str, latency_s: float, usage: dict[str, int] | None, retries: int, failed: bool) -> None:
        with self._lock:
            stats = self.roles.setdefault(role, RoleStats())
            stats.requests += 1
            stats.failures += int(failed)
            stats.retries += retries
            stats.latencies_s.append(latency_s)
            if usage:
                stats.prompt_tokens += usage.get("prompt_tokens", 0)
                stats.completion_tokens += usage.get("completion_tokens", 0)

    def summary(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {role: {
                "requests": s.requests, "failures": s.failures, "retries": s.retries,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "latency_p50_s": round(float(np.percentile(s.latencies_s, 50)), 4),
                "latency_p95_s": round(float(np.percentile(s.latencies_s, 95)), 4),
                "latency_total_s": round(sum(s.latencies_s), 3),
            } for role, s in self.roles.items()}


class Backend(Protocol):
    def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        """Send one request; returns (response JSON, retries used) or raises ClientError."""


class HttpBackend:
    """httpx with bounded retries and exponential backoff with jitter."""

    RETRY_STATUS = {429, 500, 502, 503, 504}

    def __init__(self, base_url: str, timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
                 api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.max_retries, self.backoff_s = max_retries, backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        for attempt in range(self.max_retries + 1):
            try:
                response = self._http.request(method, path, json=payload)
            except httpx.TransportError as exc:  # connection refused, reset, timeouts
                failure = ClientError(0, f"{exc.__class__.__name__} calling {self.base_url}{path}: {exc}")
            else:
                if response.status_code < 400:
                    return response.json(), attempt
                failure = ClientError(response.status_code, _reason(response))
                if response.status_code not in self.RETRY_STATUS:
                    raise failure
            if attempt == self.max_retries:
                raise failure
            time.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        raise failure  # only reached with max_retries < 0

    def close(self) -> None:
        self._http.close()


def _reason(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase


class InProcessBackend:
    """Calls the engine through the server's own handlers: same validation, same response shapes."""

    ROUTES = {
        "/v1/chat/completions": (server.ChatRequest, server.handle_chat),
        "/v1/completions": (server.CompletionRequest, server.handle_completion),
        "/v1/embeddings": (server.EmbeddingRequest, server.handle_embeddings),
        "/v1/compress": (server.CompressRequest, server.handle_compress),
    }

    def __init__(self, engine: EmbeddedEngine):
        self.engine = engine

    def request(self, method: str, path: str, payload: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        try:
            if path == "/v1/models":
                return server.handle_models(self.engine), 0
            if path == "/health":
                return {"status": "ok", "roles": self.engine.roles}, 0
            model, handler = self.ROUTES[path]
            return handler(self.engine, model.model_validate(payload or {})), 0
        except server.ApiError as exc:
            raise ClientError(exc.status, exc.message) from exc
        except ValidationError as exc:
            raise ClientError(400, str(exc.errors()[0]["msg"])) from exc

    def close(self) -> None:
        pass


class Client:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.stats = UsageStats()

    @classmethod
    def from_url(cls, url: str, **http_options: Any) -> Client:
        """A client for an OpenAI-compatible server at ``url`` (with or without the /v1 suffix)."""
        return cls(HttpBackend(url.removesuffix("/v1"), **http_options))

    @classmethod
    def in_process(cls, engine: EmbeddedEngine) -> Client:
        return cls(InProcessBackend(engine))

    def _call(self, role: str, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        try:
            response, retries = self.backend.request("POST", path, payload)
        except ClientError:
            self.stats.record(role, time.perf_counter() - started, None, 0, failed=True)
            raise
        latency = time.perf_counter() - started
        self.stats.record(role, latency, response.get("usage"), retries, failed=False)
        return response, latency

    def chat(self, role: str, messages: list[dict[str, str]], **params: Any) -> ChatResult:
        """Chat completion from the model serving ``role``; params are OpenAI's (max_tokens, temperature...)."""
        response, latency = self._call(role, "/v1/chat/completions", {"model": role, "messages": messages, **params})
        choice = response["choices"][0]
        return ChatResult(choice["message"]["content"] or "", choice["finish_reason"], response["usage"], latency,
                          response)

    def complete(self, role: str, prompt: str, **params: Any) -> ChatResult:
        """Raw text completion (no chat template)."""
        response, latency = self._call(role, "/v1/completions", {"model": role, "prompt": prompt, **params})
        choice = response["choices"][0]
        return ChatResult(choice["text"], choice["finish_reason"], response["usage"], latency, response)

    def embed(self, role: str, texts: list[str]) -> np.ndarray:
        """Embeddings as a (len(texts), dim) float32 array, in input order."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        response, _ = self._call(role, "/v1/embeddings", {"model": role, "input": list(texts)})
        rows = sorted(response["data"], key=lambda item: item["index"])
        return np.asarray([row["embedding"] for row in rows], dtype=np.float32)

    def compress(self, role: str, groups: list[list[str]] | None = None,
                 embeddings: list[np.ndarray] | None = None) -> np.ndarray:
        """One compressed embedding per group of child chunks (texts, or child embedding arrays)."""
        payload: dict[str, Any] = {"model": role}
        if groups is not None:
            payload["input"] = [list(g) for g in groups]
        if embeddings is not None:
            payload["embeddings"] = [np.asarray(g, dtype=np.float32).tolist() for g in embeddings]
        response, _ = self._call(role, "/v1/compress", payload)
        rows = sorted(response["data"], key=lambda item: item["index"])
        return np.asarray([row["embedding"] for row in rows], dtype=np.float32)

    def models(self) -> list[str]:
        return [m["id"] for m in self.backend.request("GET", "/v1/models")[0]["data"]]

    def health(self) -> bool:
        try:
            return self.backend.request("GET", "/health")[0].get("status") == "ok"
        except ClientError:
            return False

    def close(self) -> None:
        self.backend.close()
