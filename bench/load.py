"""A bounded mixed load test of an OpenAI-compatible server: ``overstory bench serve``'s load phase.

``mixed_load`` sends a fixed number of requests (chat, streamed chat, completions, embeddings, scoring and
deliberately malformed ones) from a fixed number of workers to one base URL on loopback, and stops by
itself after that many requests or a time limit, whichever comes first. Meanwhile a prober asks
``GET /health`` every 0.5 s and ``MemorySampler`` samples the server processes' resident memory.

Why raw HTTP (httpx) and not our ``Client``: third-party clients (the ``openai`` package, LangChain, curl)
send exactly these bytes and read exactly these answers, with no retries and no schema help; a server
that only works through our client is not OpenAI-compatible. Malformed requests are built as raw bytes
because a JSON library would refuse to write most of them (bad JSON, a lone surrogate escape).

Verdicts, per request: a valid request must answer 2xx with a well-formed body (a stream: parseable
chunks ending with ``data: [DONE]``); a malformed one must answer 4xx with OpenAI's error body
``{"error": {"message": str, "type": str, ...}}``. A 5xx or a transport error is a failure either way, and
so is a 2xx to a malformed request. Only requests that every OpenAI-compatible server must refuse are
malformed here: an empty embeddings input list (the embedded server answers it with 200 and no vectors,
OpenAI with 400) and ``stream`` with ``logprobs`` (valid for OpenAI and vLLM, refused only by the embedded
engine) are left out of the mix.

The mix is drawn with ``random.Random(seed)``: the same arguments send the same requests in the same order.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from overstory.core.memory import MemorySampler

KINDS = ("chat", "stream", "completions", "embeddings", "scoring", "malformed")
DEFAULT_WEIGHTS: dict[str, float] = {"chat": 0.35, "stream": 0.20, "completions": 0.10, "embeddings": 0.15,
                                     "scoring": 0.10, "malformed": 0.10}
# The role kind (RoleConfig.kind) a request kind needs; malformed requests need none (see MALFORMED)
NEEDS = {"chat": "chat", "stream": "chat", "completions": "chat", "embeddings": "embedding",
         "scoring": "cross-encoder"}
HEALTH_EVERY_S = 0.5
HEALTH_TIMEOUT_S = 10.0
MAX_FAILURES_KEPT = 10
BODY_HEAD = 300  # characters of a failed answer's body kept in the report

# Used when the caller gives no prompts: short, varied texts (the bench passes real HotpotQA questions)
DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Name two rivers that flow through Germany.",
    "Which planet is known as the red planet?",
    "Who wrote the novel Pride and Prejudice?",
    "Explain in one sentence what photosynthesis does.",
    "How many legs does a spider have?",
    "What year did the first person walk on the Moon?",
    "Give a synonym for the word rapid.",
)


@dataclass(frozen=True)
class Planned:
    """One request of the plan: ``body`` is the exact bytes sent (None: no body)."""

    index: int
    kind: str
    case: str  # the malformed case's name; the kind itself for a valid request
    method: str
    path: str
    body: bytes | None
    expect: int = 200  # the status a correct server answers (documentation; malformed: any 4xx passes)
    n_inputs: int = 0  # embeddings: texts sent; scoring: documents sent (the answer must have as many)


@dataclass(frozen=True)
class Outcome:
    index: int
    kind: str
    case: str
    status: int  # 0: no HTTP answer (transport error or timeout)
    latency_s: float
    problem: str | None  # None: the request passed
    body_head: str = ""


def dump_json(payload: Any) -> bytes:
    """``payload`` as the JSON bytes a request sends (the retrieval load test builds its bodies with it too)."""
    # ensure_ascii keeps a lone surrogate as its \ud800 escape (valid JSON text, invalid Unicode), which is
    # what a client sends; encoding the character itself as UTF-8 would fail on this side
    return json.dumps(payload, ensure_ascii=True).encode()


@dataclass(frozen=True)
class _Roles:
    """Which served role each request kind goes to (None: the kind is not available)."""

    chat: str | None
    embedding: str | None
    scorer: str | None

    @classmethod
    def of(cls, roles: Mapping[str, str]) -> _Roles:
        def first(kind: str) -> str | None:
            return next((name for name, k in roles.items() if k == kind), None)

        # the scorer role is the only one that may be a cross-encoder (ServeConfig refuses it elsewhere)
        return cls(first("chat"), first("embedding"), "scorer" if roles.get("scorer") == "cross-encoder" else None)

    def serves(self, need: str | None) -> bool:
        return need is None or {"chat": self.chat, "embedding": self.embedding,
                                "cross-encoder": self.scorer}[need] is not None


def _chat(roles: _Roles, **extra: Any) -> dict[str, Any]:
    # an unknown role name when no chat role is served: every case below still must be refused
    return {"model": roles.chat or "generator", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, **extra}


# Malformed cases, taken in turn: (name, role kind it needs, expected status, method, path, body builder).
# Each must be refused by any OpenAI-compatible server (the expected status is the embedded server's).
_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MALFORMED: tuple[tuple[str, str | None, int, str, str, Callable[[_Roles], bytes | None]], ...] = (
    ("bad_json", None, 400, "POST", "/v1/chat/completions",
     lambda r: b'{"model": "' + (r.chat or "generator").encode() + b'", "messages": [{"role": "user", '),
    ("missing_messages", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json({"model": r.chat or "generator", "max_tokens": 8})),
    ("unknown_model", None, 404, "POST", "/v1/chat/completions",
     lambda r: dump_json({**_chat(r), "model": "no-such-model"})),
    ("negative_max_tokens", None, 400, "POST", "/v1/chat/completions", lambda r: dump_json(_chat(r, max_tokens=-5))),
    ("wrong_method", None, 405, "GET", "/v1/chat/completions", lambda r: None),
    ("content_is_a_number", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json({**_chat(r), "messages": [{"role": "user", "content": 42}]})),
    ("n_zero", None, 400, "POST", "/v1/chat/completions", lambda r: dump_json(_chat(r, n=0))),
    ("lone_surrogate", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json({**_chat(r), "messages": [{"role": "user", "content": "broken \ud800 text"}]})),
    ("unknown_response_format", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json(_chat(r, response_format={"type": "xml"}))),
    ("tool_choice_not_among_tools", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json(_chat(r, tools=[_TOOL],
                               tool_choice={"type": "function", "function": {"name": "book_flight"}}))),
    ("stream_options_without_stream", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json(_chat(r, stream=False, stream_options={"include_usage": True}))),
    ("top_logprobs_without_logprobs", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json(_chat(r, top_logprobs=3))),
    ("unknown_message_role", None, 400, "POST", "/v1/chat/completions",
     lambda r: dump_json({**_chat(r), "messages": [{"role": "wizard", "content": "hi"}]})),
    ("negative_temperature", None, 400, "POST", "/v1/chat/completions", lambda r: dump_json(_chat(r, temperature=-1))),
    ("completion_without_prompt", "chat", 400, "POST", "/v1/completions",
     lambda r: dump_json({"model": r.chat, "max_tokens": 8})),
    ("embeddings_without_input", "embedding", 400, "POST", "/v1/embeddings",
     lambda r: dump_json({"model": r.embedding})),
    ("rerank_without_documents", "cross-encoder", 400, "POST", "/v1/rerank",
     lambda r: dump_json({"model": r.scorer, "query": "what is a cross-encoder?"})),
)


def available_kinds(roles: Mapping[str, str]) -> list[str]:
    """The request kinds a server with these roles (role name -> ``RoleConfig.kind``) can be sent."""
    served = _Roles.of(roles)
    return [kind for kind in KINDS if served.serves(NEEDS.get(kind))]


def kind_counts(weights: Mapping[str, float], total: int) -> dict[str, int]:
    """Exact per-kind counts summing to ``total`` (largest remainders), so that the mix is what it says."""
    norm = sum(weights.values())
    shares = {kind: total * w / norm for kind, w in weights.items()}
    counts = {kind: int(share) for kind, share in shares.items()}
    by_remainder = sorted(shares, key=lambda kind: shares[kind] - counts[kind], reverse=True)
    for kind in by_remainder[:total - sum(counts.values())]:
        counts[kind] += 1
    return counts


def plan_requests(roles: Mapping[str, str], requests: int, max_tokens: int, seed: int = 0,
                  weights: Mapping[str, float] | None = None,
                  prompts: Sequence[str] = DEFAULT_PROMPTS) -> list[Planned]:
    """The ``requests`` requests of one load test, shuffled with ``random.Random(seed)``. Kinds the roles
    cannot serve are dropped and the other weights rescaled; malformed requests take the cases of
    ``MALFORMED`` that the roles allow in turn."""
    unknown = set(weights or {}) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown request kinds {sorted(unknown)}; kinds are {', '.join(KINDS)}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    served = _Roles.of(roles)
    kinds = available_kinds(roles)
    chosen = {k: w for k, w in (weights or DEFAULT_WEIGHTS).items() if k in kinds and w > 0}
    if not chosen:
        raise ValueError(f"no request kind left to send: the roles {dict(roles)} serve {kinds}")
    rng = random.Random(seed)
    order = [kind for kind, n in kind_counts(chosen, requests).items() for _ in range(n)]
    rng.shuffle(order)
    cases = [case for case in MALFORMED if served.serves(case[1])]
    plan, malformed_seen = [], 0
    for index, kind in enumerate(order):
        prompt = rng.choice(prompts)
        if kind == "malformed":
            name, _, expect, method, path, build = cases[malformed_seen % len(cases)]
            malformed_seen += 1
            plan.append(Planned(index, kind, name, method, path, build(served), expect))
        elif kind in ("chat", "stream"):
            messages = [{"role": "user", "content": prompt}]
            body: dict[str, Any] = {"model": served.chat, "messages": messages, "max_tokens": max_tokens}
            # half greedy, half sampled with a seed: both decoding paths carry load
            body.update({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.7, "seed": rng.randrange(1000)})
            if rng.random() < 0.3:
                messages.insert(0, {"role": "system", "content": "Answer briefly."})
            if kind == "stream":
                body.update(stream=True, stream_options={"include_usage": True})
            plan.append(Planned(index, kind, kind, "POST", "/v1/chat/completions", dump_json(body)))
        elif kind == "completions":
            body = {"model": served.chat, "prompt": f"Question: {prompt}\nAnswer:", "max_tokens": max_tokens,
                    "temperature": 0}
            plan.append(Planned(index, kind, kind, "POST", "/v1/completions", dump_json(body)))
        elif kind == "embeddings":
            texts = [rng.choice(prompts) for _ in range(rng.randint(1, 4))]
            # a single string is as valid as a list; both spellings are sent
            body = {"model": served.embedding, "input": texts[0] if len(texts) == 1 and rng.random() < 0.5 else texts}
            plan.append(Planned(index, kind, kind, "POST", "/v1/embeddings", dump_json(body), n_inputs=len(texts)))
        else:  # scoring
            documents = [rng.choice(prompts) for _ in range(rng.randint(3, 8))]
            body = {"model": served.scorer, "query": prompt, "documents": documents}
            plan.append(Planned(index, kind, kind, "POST", "/v1/rerank", dump_json(body), n_inputs=len(documents)))
    return plan


# ----------------------------------------------------------------------------------------------- checks


def _error_body_problem(body: Any) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(
            error.get("type"), str):
        return 'the error body is not OpenAI\'s {"error": {"message": str, "type": str, ...}}'
    return None


def is_number(x: Any) -> bool:
    """Whether ``x`` is a JSON number (an int or float, not a bool): a score or a vector entry."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _usage_problem(body: dict) -> str | None:
    usage = body.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return "usage.prompt_tokens missing"
    return None


def _body_problem(planned: Planned, body: Any) -> str | None:
    """Why a 2xx body of a valid request is not well-formed (None: it is)."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    if planned.kind == "chat":
        choices = body.get("choices")
        if body.get("object") != "chat.completion" or not isinstance(choices, list) or not choices:
            return "not a chat.completion with choices"
        message = choices[0].get("message") or {}
        if message.get("role") != "assistant" or not (isinstance(message.get("content"), str)
                                                      or message.get("tool_calls")):
            return "choices[0].message is not an assistant message with content"
        if not choices[0].get("finish_reason"):
            return "choices[0].finish_reason missing"
        return _usage_problem(body)
    if planned.kind == "completions":
        choices = body.get("choices")
        if body.get("object") != "text_completion" or not isinstance(choices, list) or not choices:
            return "not a text_completion with choices"
        if not isinstance(choices[0].get("text"), str) or not choices[0].get("finish_reason"):
            return "choices[0] has no text or no finish_reason"
        return _usage_problem(body)
    if planned.kind == "embeddings":
        data = body.get("data")
        if not isinstance(data, list) or len(data) != planned.n_inputs:
            return f"{planned.n_inputs} texts sent, data does not hold as many embeddings"
        vectors = [d.get("embedding") for d in data]
        if not all(isinstance(v, list) and v and all(is_number(x) for x in v) for v in vectors):
            return "an embedding is not a non-empty list of floats"
        if len({len(v) for v in vectors}) != 1 or [d.get("index") for d in data] != list(range(len(data))):
            return "embeddings differ in size or are out of order"
        return _usage_problem(body)
    if planned.kind == "scoring":
        results = body.get("results")
        if not isinstance(results, list) or len(results) != planned.n_inputs:
            return f"{planned.n_inputs} documents sent, results does not hold as many"
        scores = [r.get("relevance_score") for r in results]
        if not all(is_number(s) for s in scores) or scores != sorted(scores, reverse=True):
            return "relevance scores are not numbers sorted from best"
        if sorted(r.get("index") for r in results) != list(range(planned.n_inputs)):
            return "result indexes are not the documents' positions"
        return None
    return None


def _stream_problem(lines: list[str]) -> str | None:
    """Why a chat stream (its lines) is not well-formed: ``data:`` events of chat.completion.chunk JSON, a
    finish_reason, the usage chunk (stream_options.include_usage), then ``data: [DONE]`` and nothing after."""
    events = []
    for line in lines:
        if not line or line.startswith(":"):  # event separators and SSE comments (keep-alives)
            continue
        if not line.startswith("data:"):
            return f"not a data line: {line[:80]!r}"
        events.append(line[5:].strip())
    if not events or events[-1] != "[DONE]" or "[DONE]" in events[:-1]:
        return "the stream does not end with data: [DONE]"
    chunks = []
    for event in events[:-1]:
        try:
            chunks.append(json.loads(event))
        except ValueError:
            return f"a chunk is not JSON: {event[:80]!r}"
    if any(not isinstance(c, dict) or "error" in c for c in chunks):
        return "the stream carries an error event"
    if any(c.get("object") != "chat.completion.chunk" or not isinstance(c.get("choices"), list) for c in chunks):
        return "a chunk is not a chat.completion.chunk with choices"
    if not any(choice.get("finish_reason") for c in chunks for choice in c["choices"]):
        return "no chunk carries a finish_reason"
    if not chunks or chunks[-1]["choices"] or _usage_problem(chunks[-1]):
        return "the last chunk is not the usage chunk (include_usage was asked)"
    return None


def _judged(check: Callable[..., str | None], *args: Any) -> str | None:
    """``check(*args)``, where a body of an unexpected shape (a list where an object belongs...) that trips the
    check up is a problem of that body, not a crash of the load test."""
    try:
        return check(*args)
    except (AttributeError, TypeError, KeyError, IndexError) as exc:
        return f"the body has an unexpected shape ({exc.__class__.__name__}: {exc})"


def _head(text: str) -> str:
    return text[:BODY_HEAD]


Judge = Callable[[Planned, Any], str | None]  # why a valid request's 2xx body is not well-formed (None: it is)


def _send(http: httpx.Client, planned: Planned, judge: Judge = _body_problem) -> Outcome:
    """Send one request and judge its answer (a valid request's body with ``judge``)."""
    headers = {"content-type": "application/json"} if planned.body is not None else {}
    started = time.perf_counter()
    try:
        if planned.kind == "stream":
            with http.stream(planned.method, planned.path, content=planned.body, headers=headers) as response:
                if response.status_code // 100 == 2:
                    lines = list(response.iter_lines())
                    status, text, problem = response.status_code, "\n".join(lines), _judged(_stream_problem, lines)
                else:
                    response.read()
                    status, text, problem = response.status_code, response.text, None
        else:
            response = http.request(planned.method, planned.path, content=planned.body, headers=headers)
            status, text, problem = response.status_code, response.text, None
    except httpx.HTTPError as exc:
        return Outcome(planned.index, planned.kind, planned.case, 0, time.perf_counter() - started,
                       f"transport error: {exc.__class__.__name__}: {exc}")
    latency = time.perf_counter() - started
    if planned.kind == "malformed":
        if not 400 <= status < 500:
            problem = f"a malformed request answered {status}, not 4xx"
        else:
            try:
                problem = _error_body_problem(json.loads(text))
            except ValueError:
                problem = "the error body is not JSON"
    elif status // 100 != 2:
        problem = f"a valid request answered {status}"
    elif planned.kind != "stream":
        try:
            body = json.loads(text)
        except ValueError:
            problem = "the body is not JSON"
        else:
            problem = _judged(judge, planned, body)
    return Outcome(planned.index, planned.kind, planned.case, status, latency, problem,
                   _head(text) if problem else "")


class HealthProber:
    """``GET /health`` every ``every_s`` seconds on its own connection (so that it does not queue behind the
    load's connection pool) until stopped; counts probes, 200 answers and the slowest answer."""

    def __init__(self, base_url: str, every_s: float = HEALTH_EVERY_S, timeout_s: float = HEALTH_TIMEOUT_S,
                 headers: Mapping[str, str] | None = None):
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s, headers=dict(headers or {}))
        self.every_s = every_s
        self.probes = self.answered = 0
        self.max_latency_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="overstory-health-prober", daemon=True)

    def _loop(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                ok = self.http.get("/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latency = time.perf_counter() - started
            self.probes += 1
            self.answered += ok
            self.max_latency_s = max(self.max_latency_s, latency)
            if self._stop.wait(max(0.0, self.every_s - latency)):
                return

    def __enter__(self) -> HealthProber:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.http.close()

    def report(self) -> dict[str, Any]:
        return {"probes": self.probes, "answered": self.answered, "max_latency_s": round(self.max_latency_s, 3)}


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def mixed_load(base_url: str, roles: dict[str, str], requests: int, concurrency: int, pids: list[int],
               max_tokens: int, seed: int = 0, api_key: str | None = None, time_limit_s: float = 1800,
               weights: Mapping[str, float] | None = None, prompts: Sequence[str] = DEFAULT_PROMPTS,
               progress: bool = True) -> dict:
    """Send ``requests`` mixed requests (see ``plan_requests``) with ``concurrency`` workers to the server at
    ``base_url`` (no /v1) and report what went wrong, /health during the load and the server's memory.

    ``roles``: the served role names and their ``RoleConfig.kind``; chat kinds go to the first ``chat`` role,
    embeddings to the first ``embedding`` role, scoring to ``scorer`` when it is a ``cross-encoder`` (kinds
    no role serves are not sent). ``pids``: the server processes whose resident memory (children included)
    is sampled. Stops after ``requests`` requests or ``time_limit_s`` seconds, whichever comes first: requests
    not started by then are not sent (``time_limited``), and each request waits at most as long as the limit.
    """
    if requests < 1 or concurrency < 1 or time_limit_s <= 0:
        raise ValueError("requests and concurrency must be >= 1 and time_limit_s > 0")
    plan = plan_requests(roles, requests, max_tokens, seed, weights, prompts)
    return run_plan(base_url, plan, concurrency, pids, api_key, time_limit_s, progress)


def run_plan(base_url: str, plan: list[Planned], concurrency: int, pids: list[int], api_key: str | None = None,
             time_limit_s: float = 1800, progress: bool = True, judge: Judge = _body_problem) -> dict:
    """Send the planned requests with ``concurrency`` workers, judging valid answers with ``judge``, while /health is
    probed and the memory of ``pids`` sampled; the report of ``mixed_load``. The retrieval load test
    (``bench/retrieval_load.py``) runs its own plan through it."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + time_limit_s
    columns = (TextColumn("load {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with (httpx.Client(base_url=base_url, headers=headers, timeout=min(time_limit_s, 600.0),
                       limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)) as http,
          HealthProber(base_url, headers=headers) as health, MemorySampler(pids) as memory,
          Progress(*columns, console=Console(stderr=True), disable=not progress) as bar):
        task = bar.add_task(base_url, total=len(plan))

        def one(planned: Planned) -> None:
            if time.monotonic() > deadline:  # bounded in time: what has not started by now is not sent
                return
            outcome = _send(http, planned, judge)
            with lock:
                outcomes.append(outcome)
            bar.advance(task)

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(one, plan))
        wall = time.monotonic() - started
    return _report(plan, outcomes, concurrency, health, memory, wall)


def _report(plan: list[Planned], outcomes: list[Outcome], concurrency: int, health: HealthProber,
            memory: MemorySampler, wall: float) -> dict:
    outcomes = sorted(outcomes, key=lambda o: o.index)
    by_kind = {}
    for kind in dict.fromkeys(p.kind for p in plan):
        mine = [o for o in outcomes if o.kind == kind]
        latencies = [o.latency_s for o in mine]
        failed = sum(o.problem is not None for o in mine)
        by_kind[kind] = {"planned": sum(p.kind == kind for p in plan), "sent": len(mine), "ok": len(mine) - failed,
                         "failed": failed, "p50_s": _percentile(latencies, 50), "p95_s": _percentile(latencies, 95)}
    malformed = [o for o in outcomes if o.kind == "malformed"]
    statuses: dict[str, list[int]] = {}
    for o in malformed:
        statuses.setdefault(o.case, [])
        if o.status not in statuses[o.case]:
            statuses[o.case].append(o.status)
    failures = [o for o in outcomes if o.problem is not None]
    # the sampler's first sample is taken at once; a very short run may have only that one
    samples = memory.samples or [memory.rss_mib()]
    quarter = max(1, len(samples) // 4)
    first, last = float(np.mean(samples[:quarter])), float(np.mean(samples[-quarter:]))
    # the mean of each quarter: growth that stops after the first (warm-up) differs from a steady climb
    quarters = [round(float(np.mean(part)), 1) for part in np.array_split(np.asarray(samples), 4) if len(part)]
    sent = len(outcomes)
    return {
        "requests": len(plan), "sent": sent, "concurrency": concurrency, "time_limited": sent < len(plan),
        "by_kind": by_kind,
        "failed_valid": sum(o.problem is not None for o in outcomes if o.kind != "malformed"),
        "malformed_not_4xx": sum(not 400 <= o.status < 500 for o in malformed),
        "malformed_bad_error_body": sum(o.problem is not None and 400 <= o.status < 500 for o in malformed),
        "malformed_statuses": statuses,
        "failures": [{"index": o.index, "kind": o.kind, "case": o.case, "status": o.status, "problem": o.problem,
                      "body_head": o.body_head} for o in failures[:MAX_FAILURES_KEPT]],
        "health": health.report(),
        "rss_samples": len(samples),
        "rss_first_quarter_mib": round(first, 1), "rss_last_quarter_mib": round(last, 1),
        "rss_peak_mib": round(max(samples), 1), "rss_growth_mib": round(last - first, 1),
        "rss_quarters_mib": quarters,
        "wall_s": round(wall, 2), "requests_per_s": round(sent / wall, 2) if wall > 0 else None,
    }
