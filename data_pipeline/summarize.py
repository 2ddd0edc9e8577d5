"""One chunk's summary and its embeddings: the SmartChunk summary prompt, the check that rejects an unusable summary,
and ``summarise``, which the summaries job (``overstory data summaries``) runs over a corpus and the compressor's
evaluation runs afresh on held-out chunks.

A summary that comes back empty, or not in the source's script, is asked for again (sampled, since the greedy reply
would come back unchanged); after ``max_attempts`` the chunk fails with ``SummaryFailed``, which holds the last
error and the model's raw text.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Protocol

from overstory.core.records import Chunk, FailureRecord, SummaryRecord
from overstory.serving.client import Client, ClientError

# SmartChunk, section 4 (compression encoder): summaries of at most n = 128 tokens.
SUMMARY_PROMPT = "Summarize the following text in at most {n} tokens: {text}"


class SummarySettings(Protocol):
    """What ``summarise`` reads from a job's config (``SummariesConfig`` has these keys)."""

    @property
    def max_summary_tokens(self) -> int: ...

    @property
    def max_input_chars(self) -> int: ...  # chunks longer than this many characters are cut before summarising

    @property
    def temperature(self) -> float: ...

    @property
    def max_attempts(self) -> int: ...


class SummaryRejected(ValueError):
    """The generator's summary is unusable (empty, or not in the source text's script)."""


class SummaryFailed(Exception):
    """Every attempt failed; ``record`` holds the last error and the model's raw output."""

    def __init__(self, record: FailureRecord):
        super().__init__(record.error)
        self.record = record


def latin_share(text: str) -> float:
    """Share of letters in ``text`` that are Latin-script (1.0 when there are no letters).

    >>> latin_share("Normandy"), latin_share("诺曼底 Normandy") < 0.9
    (1.0, True)
    """
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return 1.0
    return sum("LATIN" in unicodedata.name(ch, "") for ch in letters) / len(letters)


def check_summary(summary: str, source: str) -> str:
    """The cleaned summary, or SummaryRejected when it is empty or drifts into another script."""
    cleaned = summary.strip()
    for prefix in ("Summary:", "Here is a summary:", "Sure, here is a summary:"):
        cleaned = cleaned.removeprefix(prefix).strip()
    if not cleaned:
        raise SummaryRejected("empty summary")
    if latin_share(source) > 0.9 and latin_share(cleaned) < 0.7:
        raise SummaryRejected("summary is not in the language (script) of the source text")
    return cleaned


def summarise(chunk: Chunk, children: list[Chunk], client: Client, settings: SummarySettings,
              served: Mapping[str, str] | None = None) -> SummaryRecord:
    """Summarise one chunk (retrying rejected summaries) and embed the summary and the children; ``served`` (role
    -> model, from ``served_models``) names the generator and encoder in the record ("" where not given)."""
    served = served or {}
    prompt = SUMMARY_PROMPT.format(n=settings.max_summary_tokens, text=chunk.text[: settings.max_input_chars])
    error, raw = "", ""
    for attempt in range(1, settings.max_attempts + 1):
        # a retry samples: the greedy reply would just come back again
        temperature = settings.temperature if attempt == 1 else max(settings.temperature, 0.7)
        try:
            reply = client.chat("generator", [{"role": "user", "content": prompt}],
                                max_tokens=settings.max_summary_tokens, temperature=temperature, seed=attempt)
            raw = reply.text
            summary = check_summary(reply.text, chunk.text)
        except (SummaryRejected, ClientError) as exc:
            error = str(exc)
            continue
        target = client.embed("embedder", [summary])[0]
        child_vectors = client.embed("embedder", [c.text for c in children])
        return SummaryRecord(
            id=chunk.id, doc_id=chunk.doc_id, level=chunk.level, child_ids=[c.id for c in children],
            child_embeddings=child_vectors.round(6).tolist(), summary=summary,
            target_embedding=target.round(6).tolist(), generator=served.get("generator", ""),
            encoder=served.get("embedder", ""), prompt_tokens=reply.usage["prompt_tokens"],
            completion_tokens=reply.usage["completion_tokens"], attempts=attempt)
    raise SummaryFailed(FailureRecord(chunk.id, "summaries", error, raw, settings.max_attempts))
