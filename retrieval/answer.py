"""The generator's side of retrieve-then-generate: the answer settings (``AnswerConfig``), the answer prompt, the
call that asks it (``generate_answer``) and the answer clean-up.

Shared by every strategy that answers from a ranked context (naive, SmartChunk, LATTICE, FABLE; Orion-RAG and
A-RAG use the prompt or the clean-up), the planner's QA reward and the data jobs, so every strategy asks the
generator the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.strategy import StrategyAnswer
from overstory.serving.client import Client, ClientError


@dataclass(frozen=True)
class AnswerConfig:
    """How every strategy that answers from a ranked context asks the generator (one shared prompt)."""

    max_tokens: int = 24
    context_chunks: int = 3  # chunks placed in the prompt
    max_chunk_chars: int = 1500  # each cut at this many characters

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


def answer_messages(question: str, chunks: Sequence[Chunk], max_chunk_chars: int) -> list[dict[str, str]]:
    """Chat messages for a short answer from retrieved chunks (system prompt, one example, the question)."""
    context = "\n\n".join(
        f"[{i}] {c.title}: {c.text[:max_chunk_chars]}" if c.title else f"[{i}] {c.text[:max_chunk_chars]}"
        for i, c in enumerate(chunks, 1)
    )
    return [
        {"role": "system", "content": ANSWER_SYSTEM_PROMPT},
        *ANSWER_EXAMPLE,
        {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"},
    ]


def clean_answer(text: str) -> str:
    """First line of the model's reply, without a leading 'Answer:' the model sometimes repeats."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line.removeprefix("Answer:").strip().rstrip(".")


def generate_answer(question: str, context: Sequence[Chunk], client: Client, answer: AnswerConfig,
                    evidence: Sequence[Chunk] | None = None, **details) -> StrategyAnswer:
    """Ask the ``generator`` for a short answer from ``context``; a failed request becomes a recorded failure.

    Shared by the strategies that retrieve first and generate once (naive, SmartChunk, LATTICE), so their answers
    differ only by what they retrieved."""
    evidence = list(context if evidence is None else evidence)
    try:
        reply = client.chat("generator", answer_messages(question, context[: answer.context_chunks],
                                                         answer.max_chunk_chars),
                            max_tokens=answer.max_tokens, temperature=0)
    except ClientError as exc:
        return StrategyAnswer("", "", evidence, failure="request_failed", failure_detail=str(exc), details=details)
    return StrategyAnswer(clean_answer(reply.text), reply.text, evidence, details=details)
