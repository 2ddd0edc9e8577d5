"""A bounded load test of the retrieval endpoint (``overstory serve --retriever DIR``, docs/serving.md); the command
``overstory bench retrieval`` (``overstory/retrieval_bench.py``) runs it and writes its metrics.

The chat load test's skeleton (``bench/load.py``: ``run_plan`` sends, judges, probes ``/health`` and samples the
server's memory) with a plan of its own: one-query and batched ``/v1/retrieve`` requests, Search-R1's ``/retrieve``
(with and without scores), and malformed requests that any correct server refuses with a 4xx in OpenAI's error
shape (each with the status the embedded server answers). As there, requests are raw HTTP (httpx), the mix is
drawn with ``random.Random(seed)``, and a 5xx or a 2xx to a malformed request is a failure.

A valid answer must be well-formed: ``/v1/retrieve`` one ``data`` entry per query sent, in order, each with at most
``k`` evidence chunks (``id``, ``text``, a numeric or null ``score``) and no ``failure``, and the top-level
``usage``; Search-R1's one ``result`` list per query of at most ``topk`` documents with ``contents`` (and a
``score`` each when asked).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from overstory.bench.load import DEFAULT_PROMPTS, Planned, dump_json, is_number, kind_counts, run_plan

RETRIEVAL_WEIGHTS: dict[str, float] = {"retrieve": 0.40, "batch": 0.20, "search_r1": 0.25, "malformed": 0.15}
BATCH_SIZES = (2, 8)  # the queries of a batched request, drawn between these

# Malformed cases, taken in turn: (name, expected status, method, path, body from a query: JSON, raw bytes or None)
RETRIEVAL_MALFORMED: tuple[tuple[str, int, str, str, Callable[[str], Any]], ...] = (
    ("bad_json", 400, "POST", "/v1/retrieve", lambda q: b'{"query": "' + q[:8].encode()),
    ("empty_query", 400, "POST", "/v1/retrieve", lambda q: {"query": "   "}),
    ("query_and_queries", 400, "POST", "/v1/retrieve", lambda q: {"query": q, "queries": [q]}),
    ("k_zero", 400, "POST", "/v1/retrieve", lambda q: {"query": q, "k": 0}),
    ("k_past_the_limit", 400, "POST", "/v1/retrieve", lambda q: {"query": q, "k": 1_000_000}),
    ("another_strategy", 400, "POST", "/v1/retrieve", lambda q: {"query": q, "strategy": "no-such-strategy"}),
    ("unknown_field", 400, "POST", "/v1/retrieve", lambda q: {"query": q, "topk": 3}),
    ("search_r1_without_queries", 400, "POST", "/retrieve", lambda q: {"topk": 3}),
    ("search_r1_negative_topk", 400, "POST", "/retrieve", lambda q: {"queries": [q], "topk": -1}),
    ("document_without_text", 400, "POST", "/v1/documents", lambda q: {"documents": [{"id": "load-test"}]}),
    ("delete_unknown_document", 404, "DELETE", "/v1/documents/no-such-document-in-the-index", lambda q: None),
    ("wrong_method", 405, "GET", "/v1/retrieve", lambda q: None),
)


def _bytes(body: Any) -> bytes | None:
    """A case's body as sent: raw bytes as they are, anything else as JSON."""
    return body if body is None or isinstance(body, bytes) else dump_json(body)


def plan_retrieval(requests: int, k: int, seed: int = 0, weights: Mapping[str, float] | None = None,
                   queries: Sequence[str] = DEFAULT_PROMPTS) -> list[Planned]:
    """The ``requests`` requests of one retrieval load test, shuffled with ``random.Random(seed)``; ``k`` chunks per
    query; malformed requests take the cases of ``RETRIEVAL_MALFORMED`` in turn."""
    chosen = {kind: w for kind, w in (weights or RETRIEVAL_WEIGHTS).items() if w > 0}
    if unknown := set(chosen) - set(RETRIEVAL_WEIGHTS):
        raise ValueError(f"unknown request kinds {sorted(unknown)}; kinds are {', '.join(RETRIEVAL_WEIGHTS)}")
    if not chosen or not queries or k < 1:
        raise ValueError("give at least one request kind with a weight, one query and k >= 1")
    rng = random.Random(seed)
    order = [kind for kind, n in kind_counts(chosen, requests).items() for _ in range(n)]
    rng.shuffle(order)
    plan: list[Planned] = []
    malformed_seen = 0
    for index, kind in enumerate(order):
        query = rng.choice(queries)
        if kind == "malformed":
            name, expect, method, path, build = RETRIEVAL_MALFORMED[malformed_seen % len(RETRIEVAL_MALFORMED)]
            malformed_seen += 1
            plan.append(Planned(index, kind, name, method, path, _bytes(build(query)), expect))
        elif kind == "retrieve":  # a single string, with or without k
            body = {"query": query, "k": k} if rng.random() < 0.7 else {"query": query}
            plan.append(Planned(index, kind, kind, "POST", "/v1/retrieve", dump_json(body), n_inputs=1))
        elif kind == "batch":
            batch = [rng.choice(queries) for _ in range(rng.randint(*BATCH_SIZES))]
            plan.append(Planned(index, kind, kind, "POST", "/v1/retrieve", dump_json({"queries": batch, "k": k}),
                                n_inputs=len(batch)))
        else:  # search_r1
            batch = [rng.choice(queries) for _ in range(rng.randint(1, BATCH_SIZES[1]))]
            body = {"queries": batch, "topk": k, "return_scores": rng.random() < 0.7}
            plan.append(Planned(index, kind, "search_r1_scores" if body["return_scores"] else kind, "POST",
                                "/retrieve", dump_json(body), n_inputs=len(batch)))
    return plan


def _evidence_problem(evidence: Any) -> str | None:
    if not isinstance(evidence, list) or not evidence:
        return "evidence is not a non-empty list"
    for hit in evidence:
        if not isinstance(hit.get("id"), str) or not isinstance(hit.get("text"), str):
            return "an evidence chunk has no id or text"
        if hit.get("score") is not None and not is_number(hit["score"]):
            return "an evidence score is neither a number nor null"
    return None


def retrieval_body_problem(planned: Planned, body: Any) -> str | None:
    """Why a 2xx body of a valid retrieval request is not well-formed (None: it is)."""
    if not isinstance(body, dict):
        return "the body is not a JSON object"
    if planned.kind == "search_r1":
        result = body.get("result")
        if not isinstance(result, list) or len(result) != planned.n_inputs:
            return f"{planned.n_inputs} queries sent, result does not hold as many lists"
        scored = planned.case == "search_r1_scores"
        for documents in result:
            if not isinstance(documents, list) or not documents:
                return "a query's documents are not a non-empty list"
            for entry in documents:
                document = entry.get("document") if scored else entry
                if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
                    return "a document has no contents"
                if scored and not is_number(entry.get("score")):
                    return "return_scores was asked and a score is not a number"
        return None
    data = body.get("data")
    if not isinstance(data, list) or len(data) != planned.n_inputs:
        return f"{planned.n_inputs} queries sent, data does not hold as many entries"
    if [item.get("index") for item in data] != list(range(len(data))):
        return "data entries are out of order"
    for item in data:
        if item.get("failure"):
            return f"a query's retrieval failed: {item['failure']}: {item.get('failure_detail')}"
        if problem := _evidence_problem(item.get("evidence")):
            return problem
    usage = body.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return "usage.prompt_tokens missing"
    return None


def retrieval_load(base_url: str, requests: int, concurrency: int, pids: list[int], k: int = 3, seed: int = 0,
                   api_key: str | None = None, time_limit_s: float = 1800,
                   weights: Mapping[str, float] | None = None, queries: Sequence[str] = DEFAULT_PROMPTS,
                   progress: bool = True) -> dict:
    """Send ``requests`` retrieval requests (``plan_retrieval``) with ``concurrency`` workers to the server at
    ``base_url`` (no /v1) and report as ``bench.load.mixed_load`` does: failures by kind, the malformed cases'
    statuses, /health during the load, and the resident memory of ``pids`` by quarter."""
    if requests < 1 or concurrency < 1 or time_limit_s <= 0:
        raise ValueError("requests and concurrency must be >= 1 and time_limit_s > 0")
    plan = plan_retrieval(requests, k, seed, weights, queries)
    return run_plan(base_url, plan, concurrency, pids, api_key, time_limit_s, progress, retrieval_body_problem)
