"""Multi-level keyword summaries of the leaves: the input of LATTICE's top-down tree construction.

Each passage gets 5 summaries, from the most abstract to the most specific: 1-2, 3-4, 4-6, 7-10 and
11-20 words (the paper's Figure 11 prompt, reworded). Several passages go into one prompt (the paper
batches 20); the reply is JSON through the serving structured-output schema. Passages a reply leaves
out, or gives the wrong number of levels, are asked again in a smaller batch; after ``max_attempts`` a
passage gets a fallback made from its own words (marked ``source="fallback"``) and a failure record with
the raw reply, so construction never loses a leaf. ``KeywordSummariser.summarise_batch`` does one batch; the
tree job appends its records to JSONL and skips finished ids, so a killed run resumes (a fallback counts as
finished: delete its line to ask again).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from overstory.core.records import FailureRecord
from overstory.models.json_reply import json_objects, loads_tolerant
from overstory.serving.client import Client, ClientError

LEVEL_WORDS: tuple[tuple[int, int], ...] = ((1, 2), (3, 4), (4, 6), (7, 10), (11, 20))
# Characters each level may take in a constrained reply: its word budget at about 8 characters a word. The
# caps keep a small model from rambling (and a batch's reply within max_tokens: about 100 tokens a passage).
LEVEL_MAX_CHARS: tuple[int, ...] = (24, 40, 56, 96, 176)

EXAMPLE_KEYWORDS = ("Science", "Physics and chemistry", "Pioneers of radioactivity research",
                    "Marie Curie's discovery of polonium and radium",
                    "Marie Curie discovered polonium and radium and won Nobel prizes in physics and chemistry")

KEYWORDS_PROMPT = """For each passage below, write 5 summaries of it, from the most general to the most \
specific: level 1 in 1-2 words (the broad field), level 2 in 3-4 words, level 3 in 4-6 words, level 4 in \
7-10 words, level 5 in 11-20 words (the passage's specific content). For example, a passage about Marie \
Curie's work gets: {example}.

{passages}

Reply with one JSON object: {{"passages_keywords": [{{"passage_id": id, "hierarchical_keywords": [5 \
summaries of that passage]}}, ...]}} with one entry per passage."""

# What a small model copies from the prompt instead of summarising: "level 1", "Level 2: ...", the example's lines.
_COPIED = re.compile(r"^\s*level\s*\d\b", re.IGNORECASE)


def keywords_response_format(n_passages: int) -> dict:
    """The reply schema for a batch of ``n_passages``: one entry per passage, named by its number in the prompt
    (0..n-1: a constrained decoder cannot invent one), exactly 5 summaries each, each within its level's
    ``LEVEL_MAX_CHARS``. It depends on the batch size only, so the server compiles it once and reuses it for every
    batch of that size (the length caps make a compile take seconds on CPU; ids in the schema made every batch a
    new compile, which timed out under load)."""
    entry = {
        "type": "object",
        "properties": {
            "passage_id": {"type": "integer", "minimum": 0, "maximum": max(n_passages - 1, 0)},
            "hierarchical_keywords": {"type": "array", "minItems": len(LEVEL_WORDS), "maxItems": len(LEVEL_WORDS),
                                      "prefixItems": [{"type": "string", "minLength": 1, "maxLength": n}
                                                      for n in LEVEL_MAX_CHARS], "items": False},
        },
        "required": ["passage_id", "hierarchical_keywords"],
    }
    schema = {"type": "object", "required": ["passages_keywords"],
              "properties": {"passages_keywords": {"type": "array", "items": entry,
                                                   "minItems": n_passages, "maxItems": n_passages}}}
    return {"type": "json_schema", "json_schema": {"name": "passages_keywords", "schema": schema}}


@dataclass(frozen=True)
class LeafKeywords:
    """The 5 summaries of one leaf, most abstract first; ``source`` is "llm" or "fallback"."""

    id: str
    keywords: list[str]
    source: str


def keywords_prompt(passages: Sequence[tuple[str, str]], max_chars: int) -> str:
    """The prompt for a batch of ``(passage_id, text)``, passages numbered 0..n-1 and cut to ``max_chars``."""
    blocks = [f"Passage {i}: {' '.join(text.split())[:max_chars]}" for i, (_, text) in enumerate(passages)]
    return KEYWORDS_PROMPT.format(passages="\n\n".join(blocks), example=json.dumps(list(EXAMPLE_KEYWORDS)))


def parse_keywords_reply(text: str, passage_ids: Sequence[str]) -> dict[str, list[str]]:
    """Passage id -> its 5 summaries, for each entry of the reply naming a passage of the batch by its number
    (0..n-1, as the prompt shows them) with 5 non-empty strings that are not copied from the prompt ("level 1",
    the example); anything else in the reply is ignored (its passages are asked again).

    >>> parse_keywords_reply('{"passages_keywords": [{"passage_id": 0, "hierarchical_keywords": '
    ...                      '["a", "b", "c", "d", "e"]}, {"passage_id": 7, "hierarchical_keywords": []}, '
    ...                      '{"passage_id": "1", "hierarchical_keywords": ["level 1", "b", "c", "d", "e"]}]}',
    ...                      ["p1", "p2"])
    {'p1': ['a', 'b', 'c', 'd', 'e']}
    """
    reply = next((obj for obj in map(loads_tolerant, reversed(json_objects(text)))
                  if obj is not None and isinstance(obj.get("passages_keywords"), list)), None)
    out: dict[str, list[str]] = {}
    for entry in reply["passages_keywords"] if reply else []:
        if not isinstance(entry, dict):
            continue
        position = _position(entry.get("passage_id"))
        levels = entry.get("hierarchical_keywords")
        if position is None or not 0 <= position < len(passage_ids):
            continue
        pid = passage_ids[position]
        if pid not in out and isinstance(levels, list) and len(levels) == len(LEVEL_WORDS):
            cleaned = [" ".join(str(level).split()) for level in levels]
            copied = any(_COPIED.match(level) or level in EXAMPLE_KEYWORDS for level in cleaned)
            if all(cleaned) and not copied:
                out[pid] = cleaned
    return out


def _position(value: object) -> int | None:
    """A passage number as an int: 3 and "3" read as 3; anything else is None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def fallback_keywords(text: str) -> list[str]:
    """Summaries made of the passage's own first words, one per level's word budget (used when the model
    never gave usable ones: the leaf still gets clustered, by embedding similarity in practice).

    >>> fallback_keywords("Marie Curie won two Nobel prizes in physics and chemistry")[:3]
    ['Marie Curie', 'Marie Curie won two', 'Marie Curie won two Nobel prizes']
    """
    words = text.split() or ["(empty)"]
    return [" ".join(words[:high]) for _, high in LEVEL_WORDS]


class KeywordSummariser:
    """The keyword summaries of one batch of passages through the ``generator`` role (``summarise_batch``): the
    caller decides how batches run and where their records go (``overstory data lattice-tree`` hands them to its
    fan-out: local threads or Ray workers, each with a summariser around its own client)."""

    def __init__(self, client: Client, role: str = "generator", max_attempts: int = 3, max_passage_chars: int = 1000,
                 max_tokens: int = 1024):
        self.client, self.role, self.max_attempts = client, role, max_attempts
        self.max_passage_chars, self.max_tokens = max_passage_chars, max_tokens

    def summarise_batch(self, batch: Sequence[tuple[str, str]]
                        ) -> tuple[list[LeafKeywords], list[FailureRecord], int]:
        """One batch of ``(passage_id, text)``: ask, keep what came back, ask again for the rest (in halves), then
        fall back. Returns every passage's record (``llm`` or ``fallback``), a failure record with the raw reply
        for each fallback, and the requests sent."""
        texts = dict(batch)
        pending, done, raw_by_id, calls = list(texts), [], {}, 0
        for attempt in range(self.max_attempts):
            if not pending:
                break
            size = max(1, len(pending) // (2 ** attempt))
            still: list[str] = []
            for start in range(0, len(pending), size):
                ids = pending[start: start + size]
                prompt = keywords_prompt([(pid, texts[pid]) for pid in ids], self.max_passage_chars)
                calls += 1
                try:
                    reply = self.client.chat(self.role, [{"role": "user", "content": prompt}],
                                             max_tokens=self.max_tokens, temperature=0.0,
                                             response_format=keywords_response_format(len(ids)))
                except ClientError as exc:
                    raw_by_id.update({pid: f"<request failed: {exc}>" for pid in ids})
                    still.extend(ids)
                    continue
                parsed = parse_keywords_reply(reply.text, ids)
                for pid in ids:
                    if pid in parsed:
                        done.append(LeafKeywords(pid, parsed[pid], "llm"))
                    else:
                        raw_by_id[pid] = reply.text
                        still.append(pid)
            pending = still
        failures = [FailureRecord(id=pid, job="lattice keywords", error="no usable summaries in the reply",
                                  raw=raw_by_id.get(pid, ""), attempts=self.max_attempts) for pid in pending]
        done.extend(LeafKeywords(pid, fallback_keywords(texts[pid]), "fallback") for pid in pending)
        return done, failures, calls
