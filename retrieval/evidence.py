"""What the Python API returns (retrieval/api.py): a question's evidence chunks, an answer, and what each cost.

Plain frozen dataclasses, so the HTTP routes (serving/retrieval_routes.py) and the evaluation harness read the same
records a program gets from ``Retriever.retrieve`` and ``Retriever.answer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from overstory.core.records import Chunk
from overstory.serving.client import Client


@dataclass(frozen=True)
class Evidence:
    """One evidence chunk: a node of its document's hierarchy, and the strategy's score for it (None where the
    strategy ranks without scores)."""

    id: str
    doc_id: str
    text: str
    level: str
    score: float | None
    title: str = ""
    start: int = 0  # the chunk's span in its document's text
    end: int = 0

    @classmethod
    def of(cls, chunk: Chunk, score: float | None) -> Evidence:
        return cls(chunk.id, chunk.doc_id, chunk.text, chunk.level, None if score is None else float(score),
                   chunk.title, chunk.start, chunk.end)


def usage_by_role(client: Client) -> dict[str, dict[str, int]]:
    """What ``client`` spent, by role: requests (``calls``), prompt and completion tokens, failed requests."""
    return {role: {"calls": s["requests"], "prompt_tokens": s["prompt_tokens"],
                   "completion_tokens": s["completion_tokens"], "failed_calls": s["failures"]}
            for role, s in client.stats.summary().items()}


@dataclass(frozen=True)
class Cost:
    """What one call spent: per role, ``calls``, ``prompt_tokens``, ``completion_tokens`` and ``failed_calls`` (the
    servers' usage), and the seconds it took. ``fallbacks``: for a build or an add, the model replies that fell back
    to the strategy's own stand-in, by kind (FABLE: ``chunk``, ``group``, ``summary``; Orion-RAG: ``master_tags``,
    ``paragraph_tags``); {} where the strategy asks for none."""

    roles: dict[str, dict[str, int]]
    seconds: float
    fallbacks: dict[str, int] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        """Requests over every role (the embedder's included)."""
        return sum(role["calls"] for role in self.roles.values())

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens over every role."""
        return sum(role["prompt_tokens"] + role["completion_tokens"] for role in self.roles.values())


@dataclass(frozen=True)
class Retrieved:
    """A question's evidence, best first, and its cost; ``failure`` is "" unless the retrieval failed (a request
    that failed after the client's retries: ``request_failed``, with the error in ``failure_detail``)."""

    evidence: list[Evidence]
    cost: Cost
    failure: str = ""
    failure_detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # what the strategy did: plan, sub-queries, slates...


@dataclass(frozen=True)
class Answered:
    """The generator's answer (``text``: cleaned; ``raw``: its reply), the evidence it was given and the cost."""

    text: str
    raw: str
    evidence: list[Evidence]
    cost: Cost
    failure: str = ""
    failure_detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def evidence_list(chunks: Sequence[Chunk], scores: Sequence[float | None]) -> list[Evidence]:
    """Chunks with their scores (None past the end of ``scores``)."""
    return [Evidence.of(chunk, scores[i] if i < len(scores) else None) for i, chunk in enumerate(chunks)]
