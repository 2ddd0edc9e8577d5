"""What every retrieval strategy gives the evaluation harness: one answer per question, with its evidence.

A strategy (naive top-k, SmartChunk, LATTICE, FABLE, A-RAG, Orion-RAG) is built once over a corpus (its index
cost is its own business, reported by its data job) and then answers questions one at a time through the client
it is handed. The harness hands each question a client of its own (``Client.fork``) so the calls and tokens the
strategy spends on that question, split by role, are counted without the strategy doing anything.

A question may come with its document scope: the ids of the documents it is about (QASPER asks about one paper,
NarrativeQA about one story, SQuAD about one article), and the strategy then retrieves from those documents only:
its index search, its tree or its tools restricted to them. ``None`` is the open corpus (HotpotQA, or an
open-corpus variant of a document-scoped dataset), where it searches everything. The evaluation harness decides
which (``scope`` in ``eval pipeline``'s config).

Strategies that retrieve first and answer from what they retrieved (naive, SmartChunk, LATTICE, FABLE, Orion-RAG)
split ``answer`` into its two steps: ``retrieve_evidence`` (the evidence with its scores, and what the retrieval
did) and the generator's answer from it, and ``answer`` calls ``retrieve_evidence``, so retrieving alone
(``overstory.retrieval.api``'s ``retrieve``) and answering take one path. A-RAG's agent interleaves reading and
answering, so it has no retrieval step of its own.

A strategy never raises for one bad question: a reply it cannot use becomes ``failure`` (a short kind, counted
by the harness) with the raw text kept in ``failure_detail``, and the prediction is whatever answer it could
still give ("" if none). Only a broken setup raises: no server, a bad config, or a request the server refuses for
a reason no retry mends (``RequestRefused``: a 4xx other than 408 and 429, such as a wrong role or model name).
Transient request failures (``transient``) are counted where they happen, so a rerun can ask again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from overstory.core.records import Chunk
from overstory.serving.client import Client, ClientError

# 4xx statuses that a later try can get through: a request timeout, too many requests
TRANSIENT_4XX = frozenset({408, 429})


@dataclass
class StrategyAnswer:
    prediction: str  # the short answer, cleaned (retrieval.answer.clean_answer); "" when there is none
    raw: str  # the generator's final reply as it came
    # what the strategy retrieved or read, best first: recall@k against gold spans, QASPER's predicted_evidence
    evidence: list[Chunk] = field(default_factory=list)
    failure: str = ""  # "" on success; else a kind such as "request_failed", "no_tool_call", "budget_exhausted"
    failure_detail: str = ""  # the raw reply or the error behind ``failure``
    details: dict[str, Any] = field(default_factory=dict)  # strategy specific: turns, sub-queries, plan...
    # one per evidence chunk where the strategy scored what it retrieved (None for a chunk without a score); empty
    # for a strategy that does not score (A-RAG's agent, the BM25 floor)
    scores: list[float | None] = field(default_factory=list)


@dataclass
class Retrieval:
    """The evidence a strategy retrieved for one question, best first, before any answer is generated."""

    evidence: list[Chunk] = field(default_factory=list)
    # one per evidence chunk: the strategy's own score (similarity, fused RRF, path relevance); None where the
    # strategy ranks without a score (FABLE's reading order)
    scores: list[float | None] = field(default_factory=list)
    failure: str = ""  # as StrategyAnswer's: "" on success, else a kind such as "request_failed"
    failure_detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # strategy specific: plan, sub-queries, slates...

    def scored(self, answer: StrategyAnswer) -> StrategyAnswer:
        """``answer`` (given this evidence) with this retrieval's scores beside its evidence."""
        answer.scores = list(self.scores[: len(answer.evidence)])
        return answer

    def failed_answer(self) -> StrategyAnswer:
        """The answer of a question whose retrieval failed: no prediction, the failure and details kept."""
        return StrategyAnswer("", "", list(self.evidence), failure=self.failure, failure_detail=self.failure_detail,
                              details=self.details)


class Strategy(Protocol):
    """A built retrieval strategy. ``name`` is what the harness's table shows."""

    name: str

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Retrieve for ``question`` (from the documents ``scope`` names only, when given) and let the ``generator``
        role answer, every call through ``client``."""
        ...


class RetrievingStrategy(Strategy, Protocol):
    """A strategy that retrieves first and answers from what it retrieved, with the retrieval as a step of its own."""

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """The evidence for ``question`` (from the documents ``scope`` names only, when given), at most ``k`` chunks
        (None: the strategy's own setting), every call through ``client``."""
        ...


class RequestRefused(RuntimeError):
    """The server refused a strategy's request for a reason retrying will not fix (``transient`` is False): every
    question would fail the same way, so the strategy raises instead of answering from a failed slate or an empty
    selection. Not a ClientError, so a handler of transient request failures does not swallow it."""

    def __init__(self, what: str, exc: ClientError):
        super().__init__(f"{what}: the server refused the request with {exc} (HTTP {exc.status}); a 4xx does not go "
                         "away by retrying: check the stack's roles and model names (server_url / serve)")
        self.status = exc.status


def transient(exc: ClientError) -> bool:
    """Whether a failed request may go through on a later try: a transport failure or timeout (status 0), a 408 or
    429, or a server error (5xx) left after the client's retries. Any other 4xx is a refusal (``RequestRefused``).

    >>> [transient(ClientError(s, "x")) for s in (0, 408, 429, 500, 503, 400, 401, 404, 422)]
    [True, True, True, True, True, False, False, False, False]
    """
    return exc.status == 0 or exc.status >= 500 or exc.status in TRANSIENT_4XX


def raise_if_refused(exc: ClientError, what: str) -> None:
    """Raise ``RequestRefused`` (from ``exc``) unless ``exc`` is transient; ``what`` names the request."""
    if not transient(exc):
        raise RequestRefused(what, exc) from exc
