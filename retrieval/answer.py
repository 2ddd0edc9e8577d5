"""The generator's side of retrieve-then-generate: the answer prompt and the answer clean-up.

Shared by the RAG baseline, SmartChunk retrieval and (later) the planner's QA reward, so every
strategy asks the generator the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from overstory.core.records import Chunk

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
