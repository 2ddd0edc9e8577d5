"""The retrieval endpoint: a persisted retriever served beside the models (``overstory serve --retriever DIR``).

    POST   /v1/retrieve          {"query": str} or {"queries": [str, ...]}, optional "k" and "strategy":
                                 evidence per query (id, doc_id, title, text, level, score, span), usage by role
    POST   /v1/documents         {"documents": [{"id", "title", "text", "metadata"}], "replace": false}: indexed
                                 in place (an id already held is a 409 unless "replace": true); what the add cost
                                 (usage by role, seconds) and the model replies that fell back (fallbacks)
    DELETE /v1/documents/{id}    removed in place (an id not held is a 404)
    POST   /retrieve             Search-R1's retriever call, {"queries", "topk", "return_scores"}, answered in its
                                 shape: {"result": [[{"document": {"id", "contents", ...}, "score"}, ...], ...]}

The routes sit behind the same API key as the chat endpoints (``/retrieve`` is added to the guarded paths) and
answer errors in the same OpenAI error body: a request the models cannot hold (a made-up field, an empty query, a
``k`` past the index, a strategy the index was not built for) is a 400 naming the field, an unknown document a 404,
an existing one a 409, a query whose model call failed after retries a 503 on Search-R1's path (its shape has no
room for a per-query failure) and a per-query ``failure`` on ours.

Serving sits below retrieval, so this module knows the retriever only through ``RetrievalService``; the top layer
(``overstory/serve.py``) wraps a ``retrieval.api.Retriever`` into one. The service raises ``serving.errors``
(``BadRequest``, ``NotFound``, ``Conflict``, ``NotReady``; ``UnknownModel`` for another ``model``), which the
server's error handlers map to their statuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Protocol

from fastapi import FastAPI
from pydantic import AfterValidator, Field, model_validator

from overstory.serving.errors import BadRequest, NotReady, UnknownModel
from overstory.serving.protocol import StrictRequest, Text, label

SEARCH_R1_PATH = "/retrieve"  # Search-R1's retriever URL is http://<host>:<port>/retrieve
RETRIEVER_MODEL = "retriever"  # the name a request's optional ``model`` field may give the served retriever


@dataclass(frozen=True)
class QueryResult:
    """One query's evidence, best first (each a mapping of id, doc_id, title, text, level, score, start, end), what
    it cost by role (calls, prompt_tokens, completion_tokens, failed_calls) and the seconds it took; ``failure`` is
    "" unless a model call failed for good (``request_failed``, the error in ``failure_detail``)."""

    evidence: list[Mapping[str, Any]]
    usage: dict[str, dict[str, int]]
    seconds: float
    failure: str = ""
    failure_detail: str = ""


@dataclass(frozen=True)
class Indexed:
    """What an add did: the ids added and the ids replaced, what it cost by role (as ``QueryResult.usage``) and in
    seconds, and the model replies that fell back to the strategy's stand-in while indexing, by kind."""

    added: list[str]
    replaced: list[str] = field(default_factory=list)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0
    fallbacks: dict[str, int] = field(default_factory=dict)


class RetrievalService(Protocol):
    """A served retriever. ``strategy`` names what its index was built for; ``max_k`` is the most chunks one query
    may ask for; ``max_queries`` the most queries one request may send. Errors are ``serving.errors``."""

    strategy: str
    max_k: int
    max_queries: int

    def retrieve(self, queries: Sequence[str], k: int | None) -> list[QueryResult]:
        """Each query's evidence, in order; ``k`` None: the strategy's own setting."""

    def add(self, documents: list[dict[str, Any]], replace: bool) -> Indexed:
        """Index ``documents`` ({id, title, text, metadata}) in place; an id already held is a ``Conflict`` unless
        ``replace``."""

    def remove(self, doc_id: str) -> None:
        """Drop document ``doc_id`` from the index in place; an id not held is ``NotFound``."""

    def document_count(self) -> int:
        """How many documents the index holds now."""


# ------------------------------------------------------------------------------------------------ requests


def _not_blank(text: str) -> str:
    """A query must hold more than whitespace."""
    if not text.strip():
        raise ValueError("a query must not be empty")
    return text


Query = Annotated[Text, AfterValidator(_not_blank)]


class RetrieveRequest(StrictRequest):
    """``/v1/retrieve``: one ``query`` or a batch of ``queries``, at most ``k`` chunks each (None: the strategy's own
    setting); ``strategy``, when given, must be the one the served index was built for."""

    query: Query | None = None
    queries: list[Query] | None = None
    k: int | None = Field(default=None, ge=1)
    strategy: str | None = None
    model: str | None = None  # optional; overstory's Client routes a request by it: "retriever"
    user: str | None = label()

    @model_validator(mode="after")
    def _one_form(self) -> RetrieveRequest:
        if (self.query is None) == (self.queries is None):
            raise ValueError("give either query (one question) or queries (a list of them)")
        if self.queries is not None and not self.queries:
            raise ValueError("queries is empty")
        return self

    def texts(self) -> list[str]:
        """The queries, one or many, as a list."""
        return [self.query] if self.query is not None else list(self.queries or [])


class DocumentIn(StrictRequest):
    """A document to index: blank lines separate its paragraphs, as in the corpora."""

    id: str = Field(min_length=1)
    title: Text = ""
    text: Text
    metadata: dict[str, Any] = Field(default_factory=dict)


class DocumentsRequest(StrictRequest):
    """``/v1/documents``: documents to index in place; ``replace`` lets one replace a document already held."""

    documents: list[DocumentIn] = Field(min_length=1)
    replace: bool = False
    model: str | None = None
    user: str | None = label()


class SearchR1Request(StrictRequest):
    """Search-R1's retriever request (``search_r1/search/retrieval_server.py``'s ``QueryRequest``)."""

    queries: list[Query] = Field(min_length=1)
    topk: int | None = Field(default=None, ge=1)
    return_scores: bool = False


# ------------------------------------------------------------------------------------------------ handlers


def _check_model(model: str | None) -> None:
    if model is not None and model != RETRIEVER_MODEL:
        raise UnknownModel(f"model {model!r} is not served here; the retriever's name is {RETRIEVER_MODEL!r} (or leave "
                       "model out)")


def _check_request(service: RetrievalService, queries: Sequence[str], k: int | None, k_name: str) -> None:
    """A ``BadRequest`` for a batch over ``service.max_queries`` or a ``k`` past ``service.max_k``."""
    if len(queries) > service.max_queries:
        raise BadRequest(f"{len(queries)} queries in one request; this server takes at most {service.max_queries} "
                         "(send several requests)", param="queries")
    if k is not None and k > service.max_k:
        raise BadRequest(f"{k_name}={k} is more than the index can return (at most {service.max_k})", param=k_name)


def totals(usages: Sequence[Mapping[str, Mapping[str, int]]]) -> dict[str, Any]:
    """OpenAI-style totals (prompt, completion and total tokens) plus model calls and failed calls, summed over
    ``usages`` (each by role), with the sums by role under ``by_role``."""
    by_role: dict[str, dict[str, int]] = {}
    for usage in usages:
        for role, counts in usage.items():
            mine = by_role.setdefault(role, {})
            for name, value in counts.items():
                mine[name] = mine.get(name, 0) + int(value)
    summed = {name: sum(role.get(name, 0) for role in by_role.values())
              for name in ("prompt_tokens", "completion_tokens", "calls", "failed_calls")}
    return {"prompt_tokens": summed["prompt_tokens"], "completion_tokens": summed["completion_tokens"],
            "total_tokens": summed["prompt_tokens"] + summed["completion_tokens"], "calls": summed["calls"],
            "failed_calls": summed["failed_calls"], "by_role": by_role}


def handle_retrieve(service: RetrievalService, request: RetrieveRequest) -> dict[str, Any]:
    """``/v1/retrieve``: each query's evidence with its usage, and the request's usage in total."""
    _check_model(request.model)
    if request.strategy is not None and request.strategy != service.strategy:
        raise BadRequest(f"strategy {request.strategy!r}: the served index was built for {service.strategy!r}; build "
                         f"and save a {request.strategy} retriever (Retriever.build({request.strategy!r}, ...).save"
                         f"(DIR)) and serve it with `overstory serve --retriever DIR`", param="strategy")
    queries = request.texts()
    _check_request(service, queries, request.k, "k")
    results = service.retrieve(queries, request.k)
    return {"object": "list", "model": RETRIEVER_MODEL, "strategy": service.strategy,
            "data": [{"object": "retrieval", "index": i, "query": query, "evidence": list(result.evidence),
                      "usage": result.usage, "seconds": result.seconds, "failure": result.failure or None,
                      "failure_detail": result.failure_detail or None}
                     for i, (query, result) in enumerate(zip(queries, results))],
            "usage": totals([result.usage for result in results])}


def search_r1_document(evidence: Mapping[str, Any]) -> dict[str, Any]:
    """A chunk as a Search-R1 corpus row: ``contents`` is the quoted title, a newline, then the text (the wiki-18
    corpus's form, which Search-R1's rollout splits back into title and text), plus the chunk's own fields."""
    title = evidence.get("title") or evidence.get("doc_id", "")
    return {"id": evidence["id"], "contents": f'"{title}"\n{evidence["text"]}', "title": title,
            "text": evidence["text"], "doc_id": evidence.get("doc_id"), "level": evidence.get("level")}


def handle_search_r1(service: RetrievalService, request: SearchR1Request) -> dict[str, Any]:
    """Search-R1's ``/retrieve``: per query, its documents, or ``{"document", "score"}`` pairs with
    ``return_scores``; ``usage`` beside ``result`` (Search-R1 reads only ``result``)."""
    _check_request(service, request.queries, request.topk, "topk")
    results = service.retrieve(request.queries, request.topk)
    if failed := next((r for r in results if r.failure), None):
        raise NotReady(f"a query's retrieval failed ({failed.failure}: {failed.failure_detail}); retry the request")
    result = []
    for found in results:
        documents = [search_r1_document(evidence) for evidence in found.evidence]
        result.append([{"document": document, "score": evidence.get("score")}
                       for document, evidence in zip(documents, found.evidence)] if request.return_scores
                      else documents)
    return {"result": result, "usage": totals([r.usage for r in results])}


def handle_add(service: RetrievalService, request: DocumentsRequest) -> dict[str, Any]:
    """``/v1/documents``: the ids added and replaced, the index's size after, what the add cost (``usage`` as
    ``/v1/retrieve``'s, ``seconds``) and the replies that fell back (``fallbacks``, by kind)."""
    _check_model(request.model)
    ids = [document.id for document in request.documents]
    if repeated := sorted({i for i in ids if ids.count(i) > 1}):
        raise BadRequest(f"documents: repeated id(s) {', '.join(repeated)}", param="documents")
    done = service.add([document.model_dump() for document in request.documents], request.replace)
    return {"object": "list", "added": done.added, "replaced": done.replaced, "documents": service.document_count(),
            "usage": totals([done.usage]), "seconds": done.seconds, "fallbacks": done.fallbacks}


def handle_remove(service: RetrievalService, doc_id: str) -> dict[str, Any]:
    """``DELETE /v1/documents/{id}``: OpenAI's deletion shape."""
    service.remove(doc_id)
    return {"id": doc_id, "object": "document", "deleted": True, "documents": service.document_count()}


def mount_retrieval(app: FastAPI, service: RetrievalService) -> None:
    """Add the retrieval routes to ``app`` (sync handlers: Starlette runs them in its thread pool, so a long batch
    does not hold up the event loop)."""

    @app.post("/v1/retrieve")
    def retrieve(request: RetrieveRequest) -> dict[str, Any]:
        return handle_retrieve(service, request)

    @app.post(SEARCH_R1_PATH)
    def search_r1(request: SearchR1Request) -> dict[str, Any]:
        return handle_search_r1(service, request)

    @app.post("/v1/documents")
    def add_documents(request: DocumentsRequest) -> dict[str, Any]:
        return handle_add(service, request)

    @app.delete("/v1/documents/{doc_id:path}")
    def remove_document(doc_id: str) -> dict[str, Any]:
        return handle_remove(service, doc_id)
