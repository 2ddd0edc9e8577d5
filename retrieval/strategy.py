"""What every retrieval strategy gives the evaluation harness: one answer per question, with its evidence.

A strategy (naive top-k, SmartChunk, LATTICE, FABLE, A-RAG, Orion-RAG) is built once over a corpus (its index
cost is its own business, reported by its data job) and then answers questions one at a time through the client
it is handed. The harness hands each question a client of its own (``Client.fork``) so the calls and tokens the
strategy spends on that question, split by role, are counted without the strategy doing anything.

A strategy never raises for one bad question: a reply it cannot use becomes ``failure`` (a short kind, counted
by the harness) with the raw text kept in ``failure_detail``, and the prediction is whatever answer it could
still give ("" if none). Only a broken setup (no server, a bad config) raises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from overstory.core.records import Chunk
from overstory.serving.client import Client


@dataclass
class StrategyAnswer:
    prediction: str  # the short answer, cleaned (retrieval.answer.clean_answer); "" when there is none
    raw: str  # the generator's final reply as it came
    # what the strategy retrieved or read, best first: recall@k against gold spans, QASPER's predicted_evidence
    evidence: list[Chunk] = field(default_factory=list)
    failure: str = ""  # "" on success; else a kind such as "request_failed", "no_tool_call", "budget_exhausted"
    failure_detail: str = ""  # the raw reply or the error behind ``failure``
    details: dict[str, Any] = field(default_factory=dict)  # strategy specific: turns, sub-queries, plan...


class Strategy(Protocol):
    """A built retrieval strategy. ``name`` is what the harness's table shows."""

    name: str

    def answer(self, question: str, client: Client) -> StrategyAnswer:
        """Retrieve for ``question`` and let the ``generator`` role answer, every call through ``client``."""
        ...
