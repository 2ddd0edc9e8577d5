"""The generator's side of retrieve-then-generate: the answer settings (``AnswerConfig``), the answer prompt, the
call that asks it (``generate_answer``) and the answer clean-up.

With ``cite`` the generator is also asked for the numbered passages its answer rests on ("Paris [1]"): the reply's
bracketed numbers are read tolerantly (``[1]``, ``[1, 3]``, ``[1-2]``, ``[passage 2]``; numbers of no passage
ignored) into ``details["citation"]``: ``status`` ``cited`` with the passages and their spans, or ``fallback`` when
no citation could be read (or the request failed), so a reader of the evidence counts those apart. An answer of
"unanswerable" rests on no passage: it is ``cited`` with none, the empty evidence QASPER's evaluator expects of an
unanswerable question.

Shared by every strategy that answers from a ranked context (naive, SmartChunk, LATTICE, FABLE; Orion-RAG and
A-RAG use the prompt or the clean-up), the planner's QA reward and the data jobs, so every strategy asks the
generator the same way.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.metrics import normalize_answer
from overstory.retrieval.strategy import StrategyAnswer, raise_if_refused
from overstory.serving.client import Client, ClientError


@dataclass(frozen=True)
class AnswerConfig:
    """How every strategy that answers from a ranked context asks the generator (one shared prompt)."""

    max_tokens: int = 24
    context_chunks: int = 3  # chunks placed in the prompt
    max_chunk_chars: int = 1500  # each cut at this many characters
    # ask for the numbered passages the answer rests on, parsed into details["citation"] (QASPER's cited evidence)
    cite: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.context_chunks < 0 or self.max_chunk_chars < 1:
            raise ConfigError("answer: max_tokens and max_chunk_chars must be >= 1, context_chunks >= 0")

ANSWER_SYSTEM_PROMPT = (
    "You answer questions from the given context. Reply with the answer only: a few words, "
    "no explanation. If the context does not contain the answer, reply 'unanswerable'."
)


# One worked example shows small models the expected answer form. Measured with SmolLM2-135M on the
# 40 HotpotQA questions (hybrid top-3 context): token F1 0.054 -> 0.084, answer-in-reply 0.20 -> 0.25.
ANSWER_EXAMPLE = [
    {"role": "user", "content": "Context:\n[1] Eiffel Tower: The Eiffel Tower is a wrought-iron lattice tower in "
                                "Paris, France, completed in 1889.\n\nQuestion: In which city is the Eiffel Tower?"
                                "\nAnswer:"},
    {"role": "assistant", "content": "Paris"},
]
CITE_INSTRUCTION = (" After the answer, give in brackets the numbers of the context passages it rests on, e.g. "
                    "'Paris [1]'; an 'unanswerable' reply cites none.")
# a bracket of passage numbers: [2], [1, 3], [1-2], [1 and 4], [passage 2], [Sources: 1; 3]
_CITATION = re.compile(r"\[\s*(?:(?:passages?|sources?)\s*:?\s*)?(\d+(?:\s*(?:,|;|and|-|–)\s*\d+)*)\s*\]", re.I)


def answer_messages(question: str, chunks: Sequence[Chunk], max_chunk_chars: int, cite: bool = False
                    ) -> list[dict[str, str]]:
    """Chat messages for a short answer from retrieved chunks (system prompt, one example, the question); with
    ``cite`` the prompt asks for the numbers of the passages the answer rests on, and the example cites its own."""
    context = "\n\n".join(
        f"[{i}] {c.title}: {c.text[:max_chunk_chars]}" if c.title else f"[{i}] {c.text[:max_chunk_chars]}"
        for i, c in enumerate(chunks, 1)
    )
    example = [ANSWER_EXAMPLE[0], {"role": "assistant", "content": "Paris [1]"}] if cite else ANSWER_EXAMPLE
    return [
        {"role": "system", "content": ANSWER_SYSTEM_PROMPT + (CITE_INSTRUCTION if cite else "")},
        *example,
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"},
    ]


def tokens_given(chunks: Sequence[Chunk], max_chunk_chars: int) -> float:
    """The tokens of the chunks' text an answer prompt carries (``answer_messages`` cuts each chunk at
    ``max_chunk_chars``): a whole chunk counts its ``n_tokens``, a cut one the share of them its kept characters hold
    (an estimate that takes a chunk's tokens as spread evenly over its characters).

    >>> chunk = Chunk("d#0", "d", "sentence", "x" * 100, None, [], 0, 100, 20)
    >>> tokens_given([chunk], 1500), tokens_given([chunk, chunk], 50)
    (20.0, 20.0)
    """
    return float(sum(c.n_tokens * min(1.0, max_chunk_chars / len(c.text)) for c in chunks if c.text))


def clean_answer(text: str) -> str:
    """First line of the model's reply, without a leading 'Answer:' the model sometimes repeats."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.removeprefix("Answer:").strip().rstrip(".")


def parse_citation(reply: str, n_passages: int) -> list[int] | None:
    """The passage numbers (1-based, first mention first, each once) the reply cites in brackets, leaving out
    numbers of no passage; None when it cites no passage there is.

    >>> parse_citation("BERT [2][1, 2]", 3), parse_citation("BERT [passage 1-3]", 2), parse_citation("BERT (1)", 3)
    ([2, 1], [1, 2], None)
    >>> parse_citation("BERT [7]", 3)
    """
    cited: list[int] = []
    for group in _CITATION.finditer(reply):
        for part in re.split(r"\s*(?:,|;|and)\s*", group[1]):
            ends = [int(n) for n in re.split(r"\s*[-–]\s*", part) if n]
            for n in range(ends[0], ends[-1] + 1):
                if 1 <= n <= n_passages and n not in cited:
                    cited.append(n)
    return cited or None


def strip_citations(reply: str) -> str:
    """The reply without its bracketed passage numbers.

    >>> strip_citations("BERT and ELMo [1, 2].")
    'BERT and ELMo.'
    """
    return re.sub(r"[ \t]*" + _CITATION.pattern, "", reply, flags=re.I)


def citation_details(reply: str, passages: Sequence[Chunk], prediction: str) -> dict[str, Any]:
    """``details["citation"]`` of a citing reply: ``cited`` with the passages' numbers and ``[doc_id, start, end]``
    spans, none for an "unanswerable" answer; ``fallback`` when the reply cites no passage that was given."""
    if normalize_answer(prediction) == "unanswerable":
        return {"status": "cited", "passages": [], "spans": []}
    cited = parse_citation(reply, len(passages))
    if cited is None:
        return {"status": "fallback", "passages": [], "spans": []}
    return {"status": "cited", "passages": cited,
            "spans": [[passages[n - 1].doc_id, passages[n - 1].start, passages[n - 1].end] for n in cited]}


def generate_answer(question: str, context: Sequence[Chunk], client: Client, answer: AnswerConfig,
                    evidence: Sequence[Chunk] | None = None, **details) -> StrategyAnswer:
    """Ask the ``generator`` for a short answer from ``context``; a transient request failure becomes a
    recorded failure, a refused one (a 4xx) raises ``RequestRefused``.

    Shared by the strategies that retrieve first and generate once (naive, SmartChunk, LATTICE), so their answers
    differ only by what they retrieved."""
    evidence = list(context if evidence is None else evidence)
    passages = context[: answer.context_chunks]
    try:
        reply = client.chat("generator", answer_messages(question, passages, answer.max_chunk_chars, answer.cite),
                            max_tokens=answer.max_tokens, temperature=0)
    except ClientError as exc:
        raise_if_refused(exc, "the answer (role 'generator')")
        if answer.cite:
            details["citation"] = {"status": "fallback", "passages": [], "spans": []}
        return StrategyAnswer("", "", evidence, failure="request_failed", failure_detail=str(exc), details=details)
    if not answer.cite:
        return StrategyAnswer(clean_answer(reply.text), reply.text, evidence, details=details)
    prediction = clean_answer(strip_citations(reply.text))
    details["citation"] = citation_details(reply.text, passages, prediction)
    return StrategyAnswer(prediction, reply.text, evidence, details=details)
