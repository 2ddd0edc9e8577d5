"""The one client the rest of overstory uses to reach served models, over HTTP or in-process.

``Client.from_url(url)`` talks to any OpenAI-compatible server (the embedded one, vLLM) with
timeouts and bounded retries (exponential backoff with jitter on connection errors, timeouts,
429 and 5xx; other 4xx fail at once with the server's reason). ``in_process_client(engine)`` in
``serving/in_process.py`` wraps a ``Client`` around an ``EmbeddedEngine`` called through the same request
handlers as the server, for tests and single-process jobs; it lives there so that an HTTP client never
imports torch or the engine.
Both record requests, failures, retries, tokens and latency per role.
"""

from __future__ import annotations

import functools
import json
import os
import random
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from overstory.serving.stack_metrics import token_totals

BACKOFF_ENV = "OVERSTORY_HTTP_BACKOFF_S"
DEFAULT_BACKOFF_S = 0.5


def default_backoff_s() -> float:
    """The wait before a client's first retry (doubling for each next one) when its caller names none:
    ``$OVERSTORY_HTTP_BACKOFF_S``, else 0.5 s. Jobs build their clients through layers that pass no backoff (the
    fan-out's threads, Ray's workers, a job's own stack); a variable reaches them all (on each node, as set there),
    so a deployment whose servers recover slowly can wait longer, and the tests of failure paths need not sleep
    through retries."""
    raw = os.environ.get(BACKOFF_ENV, "").strip()
    if not raw:
        return DEFAULT_BACKOFF_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise ValueError(f"${BACKOFF_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default certificate verification (its CA bundle, SSL_CERT_FILE and SSL_CERT_DIR as at the first
    client), made once per process: httpx builds a context for every client it makes, loading the bundle each time,
    even for plain http URLs, and jobs make a client per worker thread, per Ray task and per stage."""
    return httpx.create_ssl_context()


class ClientError(RuntimeError):
    """A request failed for good; ``status`` is the HTTP status (0 for a transport failure or timeout)
    and ``retries`` how many retries were spent before giving up."""

    def __init__(self, status: int, reason: str, retries: int = 0):
        super().__init__(f"{status or 'transport error'}: {reason}")
        self.status, self.reason, self.retries = status, reason, retries


@dataclass(frozen=True)
class ChatResult:
    text: str
    finish_reason: str
    usage: dict[str, int]
    latency_s: float
    raw: dict[str, Any] = field(repr=False)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The first choice's tool calls in OpenAI's shape (empty when the model answered in text)."""
        return list(self.raw["choices"][0].get("message", {}).get("tool_calls") or [])

    @property
    def token_logprobs(self) -> list[float]:
        """The first choice's per-token log-probabilities (empty unless the request asked for logprobs),
        from either response shape: chat (``content`` entries) or completions (``token_logprobs``)."""
        logprobs = self.raw["choices"][0].get("logprobs") or {}
        if "content" in logprobs:
            return [entry["logprob"] for entry in logprobs["content"] or []]
        return list(logprobs.get("token_logprobs") or [])


class Scores(list):
    """A cross-encoder's scores as ``/score`` (floats in input order) or ``/v1/rerank`` (``(index, score)`` pairs,
    best first) returned them: a plain list, plus ``activation``, what the server says the scores are, read from
    the response's ``activation`` key: ``"sigmoid"`` (probabilities in [0, 1]) or ``"identity"`` (raw logits), as
    the embedded server reports (``serving/cross_encoder.py``); None from a server that does not say (vLLM's
    ``/score`` and ``/v1/rerank`` apply the model's saved activation without naming it).

    >>> scores = Scores([0.2, 0.9], "sigmoid")
    >>> scores == [0.2, 0.9], scores.activation, Scores([1.5], None).activation
    (True, 'sigmoid', None)
    """

    def __init__(self, values: Iterable[Any] = (), activation: str | None = None):
        super().__init__(values)
        self.activation = activation


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

    def absorb(self, other: UsageStats) -> None:
        """Add what ``other`` counted (a forked client's accounting) to this one, so that work spread over forks is
        still counted by the client they were forked from."""
        with other._lock:
            theirs = {role: RoleStats(s.requests, s.failures, s.retries, s.prompt_tokens, s.completion_tokens,
                                      list(s.latencies_s)) for role, s in other.roles.items()}
        with self._lock:
            for role, add in theirs.items():
                mine = self.roles.setdefault(role, RoleStats())
                mine.requests += add.requests
                mine.failures += add.failures
                mine.retries += add.retries
                mine.prompt_tokens += add.prompt_tokens
                mine.completion_tokens += add.completion_tokens
                mine.latencies_s.extend(add.latencies_s)

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
    def post(self, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Send one request for the role ``payload["model"]``; (response JSON, retries used) or ClientError."""

    def get(self, path: str) -> list[dict[str, Any]]:
        """GET ``path`` from every server behind this backend, one response each."""

    def close(self) -> None:
        """Release connections."""


class HttpBackend:
    """httpx with timeouts and bounded retries with exponential backoff and jitter.

    ``base_url`` is one server for every role, or a mapping role -> server for stacks that serve
    roles from different processes (one vLLM per model); URLs are given without the /v1 suffix. ``backoff_s``:
    the wait before the first retry, ``default_backoff_s()`` when not given.
    """

    RETRY_STATUS = {429, 500, 502, 503, 504}

    def __init__(self, base_url: str | Mapping[str, str], timeout_s: float = 120.0, max_retries: int = 3,
                 backoff_s: float | None = None, api_key: str | None = None):
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s is not None and not backoff_s >= 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.urls = _strip(base_url) if isinstance(base_url, str) else {r: _strip(u) for r, u in base_url.items()}
        self.max_retries = max_retries
        self.backoff_s = default_backoff_s() if backoff_s is None else backoff_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout_s, headers=headers, verify=_tls_context())

    def _url(self, role: str) -> str:
        if isinstance(self.urls, str):
            return self.urls
        if role not in self.urls:
            raise ClientError(404, f"no server configured for role {role!r}; configured: {', '.join(self.urls)}")
        return self.urls[role]

    def post(self, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], int]:
        return self._send("POST", self._url(payload["model"]) + path, payload)

    def servers(self) -> list[str]:
        """The distinct server URLs behind the roles, in the order the roles name them."""
        return [self.urls] if isinstance(self.urls, str) else list(dict.fromkeys(self.urls.values()))

    def get(self, path: str) -> list[dict[str, Any]]:
        return [self._send("GET", url + path, None)[0] for url in self.servers()]

    def metrics_pages(self) -> dict[str, str]:
        """Each server's Prometheus ``/metrics`` page by its URL (one per distinct server behind the roles)."""
        pages = {}
        for url in self.servers():
            try:
                response = self._http.get(url + "/metrics")
            except httpx.TransportError as exc:
                raise ClientError(0, f"{exc.__class__.__name__} calling {url}/metrics: {exc}") from exc
            if response.status_code >= 400:
                raise ClientError(response.status_code, _reason(response))
            pages[url] = response.text
        return pages

    def roles_by_server(self) -> dict[str, list[str]]:
        """The roles each server answers for, where the roles are configured one by one (empty for one URL)."""
        if isinstance(self.urls, str):
            return {}
        by_url: dict[str, list[str]] = {}
        for role, url in self.urls.items():
            by_url.setdefault(url, []).append(role)
        return by_url

    def _send(self, method: str, url: str, payload: dict[str, Any] | None) -> tuple[dict[str, Any], int]:
        for attempt in range(self.max_retries + 1):
            try:
                response = self._http.request(method, url, json=payload)
            except httpx.TransportError as exc:  # connection refused or reset, timeouts
                failure = ClientError(0, f"{exc.__class__.__name__} calling {url}: {exc}", attempt)
            else:
                if response.status_code < 400:
                    return _json(response, attempt), attempt
                failure = ClientError(response.status_code, _reason(response), attempt)
                if response.status_code not in self.RETRY_STATUS:
                    raise failure
            if attempt < self.max_retries:
                time.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        raise failure

    def close(self) -> None:
        self._http.close()


def _json(response: httpx.Response, retries: int) -> dict[str, Any]:
    """The body of a successful response; empty bodies (vLLM's /health) read as {}."""
    if not response.content:
        return {}
    try:
        return response.json()
    except ValueError as exc:
        raise ClientError(response.status_code, f"response is not JSON: {response.text[:200]!r}", retries) from exc


def _strip(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _reason(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500] or response.reason_phrase


class Client:
    """Chat, completion, embedding and compression calls by role over one backend, with per-role
    accounting in ``stats``. Thread-safe: share one client across a thread pool."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.stats = UsageStats()

    @classmethod
    def from_url(cls, url: str | Mapping[str, str], **http_options: Any) -> Client:
        """A client for an OpenAI-compatible server at ``url`` (with or without the /v1 suffix), for a
        mapping role -> URL, or for the ``stack.json`` that ``overstory serve --engine vllm`` writes (a
        path ending in .json); ``http_options`` go to ``HttpBackend`` (timeout_s, max_retries, backoff_s...)."""
        if isinstance(url, str) and url.endswith(".json"):
            path = Path(url)
            if not path.is_file():
                raise FileNotFoundError(f"{url}: no such stack file (`overstory serve --engine vllm` writes "
                                        "<log_dir>/stack.json)")
            url = json.loads(path.read_text())
        return cls(HttpBackend(url, **http_options))

    def fork(self) -> Client:
        """A client over the same backend (connections shared) with accounting of its own: the evaluation
        harness forks one per question, so each question's calls and tokens by role are counted apart."""
        return Client(self.backend)

    def server_token_totals(self) -> dict[str, dict[str, int]] | None:
        """The servers' own token counters (``prompt_tokens_total`` and ``generation_tokens_total`` of their
        Prometheus /metrics, vLLM's names or the embedded server's, a vLLM stack's through its front door), keyed
        by the roles each counter stands for (``serving/stack_metrics.py``: a role, or ``a+b`` where one vLLM
        server counts several roles under one name); None when the backend is not HTTP or a server has no
        /metrics. The evaluation harness checks its per-question token sums against the change in these."""
        if not isinstance(self.backend, HttpBackend):
            return None
        try:
            pages = self.backend.metrics_pages()
        except ClientError:
            return None
        return token_totals(pages, self.backend.roles_by_server())

    def _call(self, role: str, path: str, payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        try:
            response, retries = self.backend.post(path, payload)
        except ClientError as exc:
            self.stats.record(role, time.perf_counter() - started, None, exc.retries, failed=True)
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

    def score(self, role: str, query: str, texts: list[str]) -> Scores:
        """Relevance of each text to ``query`` from a cross-encoder role (vLLM's ``/score``), in input order, with
        the response's ``activation`` (``Scores``)."""
        response, _ = self._call(role, "/score", {"model": role, "queries": query, "documents": list(texts)})
        return Scores([row["score"] for row in sorted(response["data"], key=lambda row: row["index"])],
                      response.get("activation"))

    def rerank(self, role: str, query: str, documents: list[str], top_n: int = 0) -> Scores:
        """(document index, relevance) pairs, best first, ``top_n`` of them (0: all), from vLLM's ``/v1/rerank``,
        with the response's ``activation`` (``Scores``)."""
        response, _ = self._call(role, "/v1/rerank", {"model": role, "query": query, "documents": list(documents),
                                                      "top_n": top_n})
        return Scores([(row["index"], row["relevance_score"]) for row in response["results"]],
                      response.get("activation"))

    def models(self) -> list[str]:
        """The served model names (roles), over every server behind the backend."""
        ids = [m["id"] for response in self.backend.get("/v1/models") for m in response["data"]]
        return list(dict.fromkeys(ids))

    def health(self) -> bool:
        """True when every server behind the backend answers /health (2xx)."""
        try:
            self.backend.get("/health")
        except ClientError:
            return False
        return True

    def close(self) -> None:
        self.backend.close()
