"""The SmartChunk planner's input and output: P(q, metadata(D)) -> (level_min, level_max).

The planner reads the question and the beginning of the document (about 1000 tokens), reasons
briefly and ends with one JSON object naming the largest and smallest chunk sizes to retrieve from:
``{"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}`` over the levels
sentence < paragraph < subsection < section < document.

The wording follows the structure of the SmartChunk paper's appendix E prompt (task, the five
levels, brief reasoning, JSON answer with these two keys); the paper's exact text was not available
offline, so this is our rendering of it and every trace, reward and checkpoint uses this one.

``parse_plan`` never raises: it takes the last JSON object in the reply (tolerating single quotes,
trailing commas, code fences and unquoted keys), falls back to ``key: value`` pairs outside JSON,
normalises level names (plurals, abbreviations, case), swaps a reversed range, and otherwise returns
an invalid ``Plan`` that carries the reason and the raw text (a format failure for rewards and
metrics). That tolerance is for the runtime, which should act on any readable plan. ``strict_plan_valid``
is the check for the format the prompt asks for (what ``format_valid_strict`` reports in ``eval planner``,
STITCH's step log and the GRPO logs): the last ``{...}`` parses with ``json.loads`` to an object with
exactly the two keys, both values are level names as written in ``LEVELS`` and the range is in order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from overstory.core.records import LEVELS
from overstory.models.json_reply import json_objects, loads_tolerant

SYSTEM_PROMPT = (
    "You choose how a retrieval system reads a document to answer a question. The document is split into "
    "chunks at five sizes, from smallest to largest: sentence, paragraph, subsection, section, document. "
    "Retrieval will search the chunk sizes from smallest_chunk_size up to largest_chunk_size. Pick the smallest "
    "size that can still contain the evidence and the largest size the question needs for context: narrow "
    "factual questions need small chunks, questions that combine facts or ask about themes need larger ones.\n"
    "Think in at most three short sentences, then give your answer as one JSON object on the last line:\n"
    '{"largest_chunk_size": "<size>", "smallest_chunk_size": "<size>"}'
)
USER_PROMPT = "Document (beginning):\n{metadata}\n\nQuestion: {question}"

# The structured reply a teacher writes when the server constrains it (OpenAI response_format json_schema): the
# reasoning comes first, so the model reasons before it commits to the sizes, as in the planner's own format.
# ``trace_from_structured`` turns it into that format (reasoning, then the plan line) for SFT.
TRACE_SCHEMA = {
    "type": "object",
    "properties": {
        # about 70 tokens: the trace stays under the 128-token target with the plan line after it
        "reasoning": {"type": "string", "maxLength": 300},
        "smallest_chunk_size": {"enum": list(LEVELS)},
        "largest_chunk_size": {"enum": list(LEVELS)},
    },
    "required": ["reasoning", "smallest_chunk_size", "largest_chunk_size"],
    "additionalProperties": False,
}
TRACE_RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "planner_trace", "schema": TRACE_SCHEMA}}

# Level names as models write them -> the planner's vocabulary.
_SYNONYMS = {
    "sentence": "sentence", "sent": "sentence",
    "paragraph": "paragraph", "para": "paragraph", "passage": "paragraph",
    "subsection": "subsection", "subsec": "subsection",
    "section": "section", "sec": "section",
    "document": "document", "doc": "document", "wholedocument": "document", "fulldocument": "document",
    "entiredocument": "document", "article": "document",
}
_MAX_KEYS = ("largest_chunk_size", "largest", "max_chunk_size", "level_max", "max_level", "largest_level")
_MIN_KEYS = ("smallest_chunk_size", "smallest", "min_chunk_size", "level_min", "min_level", "smallest_level")


@dataclass(frozen=True)
class Plan:
    """A parsed planner reply. ``valid`` is False when no usable range was found (``error`` says why)."""

    level_min: str | None
    level_max: str | None
    valid: bool
    error: str = ""
    swapped: bool = False  # the reply named the range the wrong way round; it was put in order
    raw: str = ""

    @property
    def levels(self) -> tuple[str, str] | None:
        return (self.level_min, self.level_max) if self.valid else None


def planner_messages(question: str, metadata: str) -> list[dict[str, str]]:
    """The chat prompt: system instructions, then the document's beginning and the question."""
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT.format(metadata=metadata.strip(), question=question.strip())}]


def document_metadata(title: str, text: str, tokenizer, max_tokens: int = 1000) -> str:
    """The planner's view of the document: its title and its first ``max_tokens`` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    head = tokenizer.decode(ids)
    return f"Title: {title}\n{head}" if title else head


def plan_json(level_min: str, level_max: str) -> str:
    """The answer line a correct plan ends with.

    >>> plan_json("paragraph", "section")
    '{"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}'
    """
    return json.dumps({"largest_chunk_size": level_max, "smallest_chunk_size": level_min})


def trace_from_structured(reply: str) -> str | None:
    """A teacher's structured reply (``TRACE_SCHEMA``) as the planner's reply format: the reasoning, then the plan
    line; None when the reply is not such an object (a server that ignored the schema, a cut-off reply).

    >>> print(trace_from_structured('{"reasoning": "A date.", "smallest_chunk_size": "sentence", '
    ...                             '"largest_chunk_size": "paragraph"}'))
    A date.
    {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}
    >>> trace_from_structured('{"reasoning": "cut off') is None
    True
    """
    try:
        value = json.loads(reply)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("reasoning"), str):
        return None
    low, high = value.get("smallest_chunk_size"), value.get("largest_chunk_size")
    if low not in LEVELS or high not in LEVELS:
        return None
    return f"{value['reasoning'].strip()}\n{plan_json(low, high)}"


def normalise_level(name: object) -> str | None:
    """Map a level name as a model wrote it to the planner's vocabulary; None when it is not a level.

    >>> [normalise_level(x) for x in ["Paragraphs", "sub-section", "SEC.", "whole document", "chapter 3", 7]]
    ['paragraph', 'subsection', 'section', 'document', None, None]
    """
    if not isinstance(name, str):
        return None
    key = re.sub(r"[^a-z]", "", name.lower())
    if key.endswith("s") and key[:-1] in _SYNONYMS:
        key = key[:-1]
    return _SYNONYMS.get(key)


def _pick(mapping: dict, keys: tuple[str, ...]) -> object:
    lowered = {str(k).strip().lower().replace(" ", "_").replace("-", "_"): v for k, v in mapping.items()}
    return next((lowered[k] for k in keys if k in lowered), None)


def strict_plan_valid(text: str) -> bool:
    """True when the reply ends its reasoning with the plan exactly as the prompt asks for it: the last
    balanced ``{...}`` is JSON (``json.loads``) with exactly ``largest_chunk_size`` and ``smallest_chunk_size``,
    both level names spelled as in ``LEVELS``, smallest <= largest. ``parse_plan`` accepts all of the replies
    below that fail here (shapes seen from SmolLM2-135M rollouts).

    >>> strict_plan_valid('Narrow fact. {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}')
    True
    >>> strict_plan_valid('{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"')  # unclosed
    False
    >>> strict_plan_valid("{'largest_chunk_size': 'section', 'smallest_chunk_size': 'sentence'}")  # single quotes
    False
    >>> strict_plan_valid('{"largest_chunk_size": "Paragraphs", "smallest_chunk_size": "sentence"}')  # plural
    False
    >>> strict_plan_valid('{"largest_chunk_size": "sentence", "smallest_chunk_size": "section"}')  # reversed
    False
    >>> strict_plan_valid('{"largest_chunk_size": "section", "smallest_chunk_size": "sentence", "why": "x"}')
    False
    """
    spans = json_objects(text)
    if not spans:
        return False
    try:
        value = json.loads(spans[-1])
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or set(value) != {"largest_chunk_size", "smallest_chunk_size"}:
        return False
    high, low = value["largest_chunk_size"], value["smallest_chunk_size"]
    return low in LEVELS and high in LEVELS and LEVELS.index(low) <= LEVELS.index(high)


def parse_plan(text: str) -> Plan:
    """Parse a planner reply; never raises.

    >>> parse_plan('Narrow fact. {"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}').levels
    ('sentence', 'paragraph')
    >>> p = parse_plan("{'largest_chunk_size': 'Sentences', 'smallest_chunk_size': 'Section',}")
    >>> p.levels, p.swapped
    (('sentence', 'section'), True)
    >>> parse_plan("I think paragraphs are best.").error
    'no JSON object with largest_chunk_size and smallest_chunk_size'
    >>> parse_plan('{"largest_chunk_size": "chapter 2", "smallest_chunk_size": "sentence"}').error
    "unknown level 'chapter 2' for largest_chunk_size"
    """
    found: dict | None = None
    for span in reversed(json_objects(text)):
        value = loads_tolerant(span)
        if value is not None and (_pick(value, _MAX_KEYS) is not None or _pick(value, _MIN_KEYS) is not None):
            found = value
            break
    if found is None:  # "largest_chunk_size: section" written without braces
        pairs = dict(re.findall(r'"?(\w+)"?\s*[:=]\s*"?([A-Za-z][\w -]*?)"?\s*(?:[,\n}]|$)', text))
        if _pick(pairs, _MAX_KEYS[:1]) is not None and _pick(pairs, _MIN_KEYS[:1]) is not None:
            found = pairs
    if found is None:
        return Plan(None, None, False, "no JSON object with largest_chunk_size and smallest_chunk_size", raw=text)
    raw_max, raw_min = _pick(found, _MAX_KEYS), _pick(found, _MIN_KEYS)
    for value, key in ((raw_max, "largest_chunk_size"), (raw_min, "smallest_chunk_size")):
        if value is None:
            return Plan(None, None, False, f"missing {key}", raw=text)
        if normalise_level(value) is None:
            return Plan(None, None, False, f"unknown level {value!r} for {key}", raw=text)
    low, high = normalise_level(raw_min), normalise_level(raw_max)
    swapped = LEVELS.index(low) > LEVELS.index(high)
    if swapped:
        low, high = high, low
    return Plan(low, high, True, swapped=swapped, raw=text)
