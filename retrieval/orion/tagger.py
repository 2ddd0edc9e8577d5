"""Orion-RAG's index side: documents cut into sliding windows of characters (``chunk_document``), and the tagger:
the ``generator`` writes each document's master tags and each chunk's three paragraph tags
(gist, subjects, domain) through reply schemas; an unusable reply is asked again, then replaced by tags made from the
text itself (``source="fallback"``), so no chunk is left untagged. A request that failed for a transient reason (a
timeout, a 5xx, after the client's retries) is asked again like an unusable reply, and the data job leaves an item
whose tags fell back after one for a rerun; a request the server refuses (a 4xx other than 408 and 429: a wrong role,
a bad request) raises ``RequestRefused`` naming the role and the server's reason, since every item would fail alike.
``overstory data orion-tags`` runs it over a corpus; the strategy (``strategy``) reads what it wrote.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bm25s.stopwords import STOPWORDS_EN_PLUS

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document, FailureRecord
from overstory.retrieval.orion.tags import (
    PARAGRAPH_TAGS,
    TAG_MAX_WORD_CHARS,
    TAG_MAX_WORDS,
    ChunkTags,
    DocumentTags,
    distinct,
    estimate_tokens,
    json_format,
    prompts_digest,
    reply_object,
)
from overstory.retrieval.strategy import raise_if_refused
from overstory.serving.client import Client, ClientError

STOPWORDS = frozenset(STOPWORDS_EN_PLUS)
# what a small model copies from the tagging prompts instead of tagging (its labels and placeholders); never a tag
PROMPT_LABELS = frozenset({"title", "start of the document", "document", "passage", "tag", "tags", "gist",
                           "subjects", "domain", "none"})


@dataclass(frozen=True)
class ChunkingConfig:
    chunk_chars: int = 500  # a window's most characters (the paper's best for generation on Wikipedia: 2,000)
    # characters a window shares with the previous one. 0: each chunk costs one tagging call and overlap multiplies
    # them (chunk_chars / (chunk_chars - overlap_chars) as many), repeats evidence in the prompt, and inflates
    # recall@k (a chunk counts when it overlaps a gold span, so overlapping windows reach more spans per k)
    overlap_chars: int = 0

    def __post_init__(self) -> None:
        if self.chunk_chars < 1:
            raise ConfigError(f"chunking.chunk_chars must be at least 1, got {self.chunk_chars}")
        if not 0 <= self.overlap_chars < self.chunk_chars:
            raise ConfigError(f"chunking.overlap_chars must be in [0, chunk_chars={self.chunk_chars}), "
                              f"got {self.overlap_chars}")


@dataclass(frozen=True)
class TaggingConfig:
    max_master_tags: int = 5  # master tags per document, at most
    master_chars: int = 1000  # the start of the document (after its title) the master tags are read from
    max_passage_chars: int = 2500  # a chunk's text is cut to this in its prompt (chunk_chars may be 2,000)
    max_tokens: int = 128  # per reply: five 40-character tags in JSON fit
    max_attempts: int = 2  # replies asked per document or chunk before the fallback tags
    concurrency: int = 4  # tagging requests in flight

    def __post_init__(self) -> None:
        for key in ("max_master_tags", "master_chars", "max_passage_chars", "max_tokens", "max_attempts",
                    "concurrency"):
            if getattr(self, key) < 1:
                raise ConfigError(f"tagging.{key} must be at least 1, got {getattr(self, key)}")


def window_spans(text: str, chunk_chars: int, overlap_chars: int = 0) -> list[tuple[int, int]]:
    """(start, end) offsets of sliding windows of at most ``chunk_chars`` characters over ``text``, without leading or
    trailing whitespace. A window ends at its last whitespace (one word longer than the window is cut inside); the
    next starts ``overlap_chars`` before that end, moved forward to the start of a word.

    >>> window_spans("aaa bbb ccc", 5)
    [(0, 3), (4, 7), (8, 11)]
    >>> window_spans("aaa bbb ccc", 7, overlap_chars=3)
    [(0, 7), (4, 11)]
    >>> window_spans(" abcdefgh ", 3)
    [(1, 4), (4, 7), (7, 9)]
    """
    spans: list[tuple[int, int]] = []
    start = _skip_space(text, 0)
    while start < len(text):
        end = min(start + chunk_chars, len(text))
        if end < len(text) and not text[end].isspace():  # the window ends inside a word
            end = next((p for p in range(end - 1, start, -1) if text[p].isspace()), end)
        stop = end
        while text[stop - 1].isspace():
            stop -= 1
        spans.append((start, stop))
        if end >= len(text):
            break
        following = max(end - overlap_chars, start + 1)
        while following < end and not text[following - 1].isspace():  # the overlap starts at a word
            following += 1
        start = _skip_space(text, following)
    return spans


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def chunk_document(document: Document, chunking: ChunkingConfig) -> list[Chunk]:
    """The document's windows as chunks: ids ``<doc id>#w<index>`` (stable for the same settings), document offsets,
    the title carried (the index and the prompts show it)."""
    return [Chunk(id=f"{document.id}#w{i}", doc_id=document.id, level="paragraph", text=document.text[start:end],
                  parent=None, children=[], start=start, end=end, n_tokens=estimate_tokens(document.text[start:end]),
                  title=document.title)
            for i, (start, end) in enumerate(window_spans(document.text, chunking.chunk_chars,
                                                          chunking.overlap_chars))]


def clean_tag(value: object) -> str:
    """A tag as one line of at most ``TAG_MAX_WORDS`` words without surrounding punctuation; "" when nothing is left
    (or ``value`` is not a string). A longer tag keeps its first words: the schema caps characters, not words, and a
    small model's first words still name the topic.

    >>> clean_tag("  Nobel  Prize in Physics, 1903. "), clean_tag(" - "), clean_tag(7)
    ('Nobel Prize in Physics', '', '')
    """
    if not isinstance(value, str):
        return ""
    return " ".join(value.split()[:TAG_MAX_WORDS]).strip(string.punctuation + " ")


def grounded(tag: str, source: str) -> bool:
    """Whether ``tag`` names something in ``source``: one of its content words (``content_words``) occurs there as a
    word.

    >>> grounded("Nobel Prize", "She won the Nobel prize."), grounded("up", "up and down"), grounded("BIM", "BIMF")
    (True, False, False)
    """
    words = set(re.findall(r"\w+", source.lower()))
    return any(word in words for word in content_words(tag))


def echoes_instructions(tag: str, source: str) -> bool:
    """Whether ``tag`` is a run of the tagging instructions' words (spaces ignored: "Reply with one JSONObject",
    "Topics") that the document's ``source`` text does not use: an echo of the prompt, not a tag. A tag grounded in
    the text ("Places" of a travel guide that speaks of places) is not an echo.

    >>> echoes_instructions("Reply with one JSONObject", "Marie Curie"), echoes_instructions("Reply", "Marie Curie")
    (True, True)
    >>> echoes_instructions("Marie Curie", "Marie Curie"), echoes_instructions("Places", "famous places to visit")
    (False, False)
    """
    return _letters(tag) in INSTRUCTION_RUNS and not grounded(tag, source)


def _letters(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def word_runs(template: str, span: int) -> frozenset[str]:
    """Every run of up to ``span`` consecutive words of ``template`` (its ``{placeholders}`` left out), letters
    only: what ``echoes_instructions`` matches a tag against.

    >>> sorted(word_runs("Reply with {n}", 2))
    ['reply', 'replywith', 'with']
    """
    words = [_letters(word) for word in re.findall(r"\w+", re.sub(r"\{[a-z]+\}", " ", template))]
    return frozenset("".join(words[i:j]) for i in range(len(words))
                     for j in range(i + 1, min(i + span, len(words)) + 1))


def parse_master_tags(text: str, max_tags: int, source: str) -> list[str]:
    """The usable master tags of a reply: cleaned, distinct, each with a content word, neither a label copied from
    the prompt nor an echo of its instructions (``echoes_instructions``), at most ``max_tags``; [] when there are
    none, or when none is ``grounded`` in the document's ``source`` text. A 135M model often answers with counting
    words, prompt echoes or inventions ("up", "1", "up to 5 shorttags", "Reply with one JSONObject"); a topic that is
    not in the text ("Geography") is kept beside tags that are.

    >>> parse_master_tags('{"tags": ["Marie Curie", "", "marie curie", 7, "Title", "up", "Physics"]}', 5,
    ...                   "Marie Curie won the Nobel Prize.")
    ['Marie Curie', 'Physics']
    >>> parse_master_tags('{"tags": ["up to 5 shorttags", "1"]}', 5, "Marie Curie won the Nobel Prize.")
    []
    >>> parse_master_tags('{"tags": []}', 5, "x"), parse_master_tags("Marie Curie, physics", 5, "Marie Curie")
    ([], [])
    >>> parse_master_tags('{"tags": ["Marie Curie", "Reply with one JSONObject"]}', 5, "Marie Curie won.")
    ['Marie Curie']
    """
    reply = reply_object(text, "tags")
    values = reply["tags"] if reply is not None and isinstance(reply["tags"], list) else []
    tags = [tag for tag in distinct(map(clean_tag, values))
            if tag.lower() not in PROMPT_LABELS and content_words(tag) and not echoes_instructions(tag, source)]
    return tags[:max_tags] if any(grounded(tag, source) for tag in tags) else []


def parse_paragraph_tags(text: str, source: str) -> list[str]:
    """gist, subjects and domain of a reply, cleaned; [] unless all three are usable: each with a content word and
    not a label copied from the prompt, not one text three times (a copy, not three facets), and the gist or the
    subjects ``grounded`` in the passage's ``source`` text.

    >>> source = "Marie Curie discovered polonium in 1898."
    >>> parse_paragraph_tags('Sure! {"gist": "Curie finds polonium", "subjects": "Marie Curie", "domain": "Chemistry"}',
    ...                      source)
    ['Curie finds polonium', 'Marie Curie', 'Chemistry']
    >>> parse_paragraph_tags('{"gist": " ", "subjects": "Marie Curie", "domain": "Chemistry"}', source)
    []
    >>> parse_paragraph_tags('{"gist": "Marie Curie was", "subjects": "Marie Curie was", "domain": "Marie Curie was"}',
    ...                      source)
    []
    >>> parse_paragraph_tags('{"gist": "The subject", "subjects": "up and down", "domain": "Chemistry"}', source)
    []
    """
    reply = reply_object(text, PARAGRAPH_TAGS[0])
    tags = [clean_tag(reply.get(key)) for key in PARAGRAPH_TAGS] if reply is not None else []
    usable = tags and all(content_words(tag) and tag.lower() not in PROMPT_LABELS for tag in tags)
    usable = usable and any(grounded(tag, source) for tag in tags[:2])
    return tags if usable and len({tag.lower() for tag in tags}) > 1 else []


def content_words(text: str) -> list[str]:
    """The text's lowercase words of 3 or more characters that are not stop words, most frequent first (ties in
    order of appearance).

    >>> content_words("Radium glows. The radium decays in the dark.")
    ['radium', 'glows', 'decays', 'dark']
    """
    words = [w for w in re.findall(r"\w+", text.lower()) if len(w) >= 3 and w not in STOPWORDS]
    return [word for word, _ in Counter(words).most_common()]


def fallback_master_tags(title: str, text: str, max_tags: int) -> list[str]:
    """Master tags made of the document's own words, when the model gave none: its title, then its most frequent
    content words not in the title.

    >>> fallback_master_tags("Marie Curie", "Marie Curie studied radium. Radium glows; radium decays.", 3)
    ['Marie Curie', 'radium', 'studied']
    """
    title_words = set(title.lower().split())
    tags = distinct([clean_tag(title), *(w for w in content_words(text) if w not in title_words)])
    return tags[:max_tags] or [clean_tag(text) or "document"]


def fallback_paragraph_tags(text: str, title: str) -> list[str]:
    """gist, subjects and domain made of the chunk's own words: its first words, its two most frequent content words,
    its document's title (or "general").

    >>> fallback_paragraph_tags("Radium glows in the dark. Radium decays.", "Marie Curie")
    ['Radium glows in the', 'radium glows', 'Marie Curie']
    """
    gist = clean_tag(text) or "passage"
    return [gist, " ".join(content_words(text)[:2]) or gist, clean_tag(title) or "general"]


# A tag in the reply schemas: 1 to TAG_MAX_WORDS words of at most TAG_MAX_WORD_CHARS characters, one space apart, the
# first not beginning with ASCII punctuation (so with a letter or digit of any script, in practice): the master
# prompt's reply form shows "..." where the tags go, and SmolLM2-135M wrote that back for every document (0 of 9
# usable on SQuAD and NarrativeQA; 6 of 9 with the first-character rule). The length bound lives in the pattern because
# xgrammar drops minLength/maxLength from a string that has a pattern (with a warning): with maxLength beside the
# pattern, the model copied whole passages into a "gist" until max_tokens cut the reply.
_WORD = rf"\S{{1,{TAG_MAX_WORD_CHARS}}}"
TAG_PATTERN = rf"^[^\s!-/:-@\[-`{{-~]\S{{0,{TAG_MAX_WORD_CHARS - 1}}}( {_WORD}){{0,{TAG_MAX_WORDS - 1}}}$"
_TAG_SCHEMA = {"type": "string", "pattern": TAG_PATTERN}
PARAGRAPH_TAGS_FORMAT = json_format("paragraph_tags", {key: _TAG_SCHEMA for key in PARAGRAPH_TAGS})


def master_tags_format(max_tags: int) -> dict[str, Any]:
    """The master-tag reply schema: 1 to ``max_tags`` tags of ``TAG_PATTERN`` (one schema for
    every document, so the server compiles its grammar once)."""
    return json_format("master_tags", {"tags": {"type": "array", "items": _TAG_SCHEMA, "minItems": 1,
                                                 "maxItems": max_tags}})


MASTER_PROMPT = """Give the master tags of the document below: up to {n} short tags of 1-4 words each, naming the \
main people, places, things and topics it is about, the most important first.

Title: {title}
Start of the document: {text}

Reply with one JSON object: {{"tags": ["...", "..."]}}."""

# Noun phrases, not sentences, with one worked reply from another field. Asked what the passage "states", the CPU
# teacher (Qwen2.5-Coder-1.5B) began a sentence ("The passage discusses the ...") that the 4-word tag pattern cut
# off, gluing words ("the_attention-based") and drifting into Chinese: on 16 QASPER dev windows 15 gists were such
# sentences, 9 glued and 4 tag sets held Chinese (1 fallback); with this prompt none were, and none fell back.
# SmolLM2-135M fell back on 13 of the 16 instead of all 16. A copied example is not grounded in the passage, so the
# parser refuses it like any other ungrounded reply.
PARAGRAPH_PROMPT = """Tag the passage below with exactly 3 short tags in English, each a noun phrase of 1-4 words \
(not a sentence): "gist" names the point this passage makes (not the whole document's topic), "subjects" names who \
or what the passage is about, "domain" names its broad field (such as music, politics, biology). For a passage on \
how vaccines train the immune system, a good reply is \
{{"gist": "vaccines train immunity", "subjects": "vaccines", "domain": "medicine"}}.

Document: {title}
Passage: {text}

Reply with one JSON object: {{"gist": "...", "subjects": "...", "domain": "..."}}."""

RETRY_PROMPT = ("That reply could not be used: every tag must be 1-4 words naming what the text is about, in its "
                "words, none empty, none repeated. Reply again with the JSON object only.")
# what a tag folder records of the prompts (data_pipeline/orion_index.py): tags asked with other prompts are not resumed
PROMPTS_DIGEST = prompts_digest(MASTER_PROMPT, PARAGRAPH_PROMPT, RETRY_PROMPT)
# the master-tag instructions as runs of a tag's 4 words and 2 more, since a small model runs some together
# ("JSONObject"); a master tag that is one of them and not in the document is an echo (``echoes_instructions``)
INSTRUCTION_RUNS = word_runs(MASTER_PROMPT + " " + RETRY_PROMPT, TAG_MAX_WORDS + 2)


@dataclass(frozen=True)
class Tagged:
    """One tagging outcome: the record (model tags or fallback), the failure behind a fallback, the calls spent."""

    record: DocumentTags | ChunkTags
    failure: FailureRecord | None
    calls: int


class Tagger:
    """Master and paragraph tags through the ``generator`` role, with retries, then fallback tags. Thread-safe."""

    def __init__(self, client: Client, config: TaggingConfig, role: str = "generator"):
        self.client, self.config, self.role = client, config, role

    def master(self, document: Document) -> Tagged:
        n = self.config.max_master_tags
        prompt = MASTER_PROMPT.format(n=n, title=document.title or "(none)",
                                      text=" ".join(document.text.split())[: self.config.master_chars])
        whole = f"{document.title}\n{document.text}"  # what the tags must be grounded in
        tags, raw, calls = self._ask("master", prompt, master_tags_format(n),
                                     lambda text: parse_master_tags(text, n, whole))
        if tags:
            return Tagged(DocumentTags(document.id, document.title, tags, "llm"), None, calls)
        fallback = fallback_master_tags(document.title, document.text[: self.config.master_chars], n)
        return Tagged(DocumentTags(document.id, document.title, fallback, "fallback"),
                      self._failure(document.id, "no usable master tags", raw), calls)

    def paragraph(self, chunk: Chunk) -> Tagged:
        prompt = PARAGRAPH_PROMPT.format(title=chunk.title or "(none)",
                                         text=" ".join(chunk.text.split())[: self.config.max_passage_chars])
        passage = f"{chunk.title}\n{chunk.text}"  # what the gist or the subjects must be grounded in
        tags, raw, calls = self._ask("paragraph", prompt, PARAGRAPH_TAGS_FORMAT,
                                     lambda text: parse_paragraph_tags(text, passage))
        source = "llm" if tags else "fallback"
        record = ChunkTags(chunk.id, chunk.doc_id, chunk.title, chunk.text, chunk.start, chunk.end,
                           tags or fallback_paragraph_tags(chunk.text, chunk.title), source)
        return Tagged(record, None if tags else self._failure(chunk.id, "no usable paragraph tags", raw), calls)

    def _ask(self, what: str, prompt: str, response_format: dict, parse: Callable[[str], list[str]]
             ) -> tuple[list[str], str, int]:
        """Up to ``max_attempts`` requests for ``what`` tags: (the tags, the last raw reply or error, the calls made).
        After an unusable reply the next request shows it with a correction, since at temperature 0 the same request
        gets the same reply; a transiently failed request is sent again as it was, a refused one raises
        ``RequestRefused``."""
        messages: list[dict[str, str]] = [{"role": "user", "content": prompt}]
        raw = ""
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                reply = self.client.chat(self.role, messages, response_format=response_format,
                                         max_tokens=self.config.max_tokens, temperature=0)
            except ClientError as exc:
                raise_if_refused(exc, f"Orion-RAG's {what} tags request (role {self.role!r})")
                raw = f"<request failed: {exc}>"
                continue
            tags = parse(reply.text)
            if tags:
                return tags, reply.text, attempt
            raw = reply.text
            messages = [messages[0], {"role": "assistant", "content": reply.text},
                        {"role": "user", "content": RETRY_PROMPT}]
        return [], raw, self.config.max_attempts

    def _failure(self, record_id: str, error: str, raw: str) -> FailureRecord:
        return FailureRecord(id=record_id, job="orion tags", error=error, raw=raw, attempts=self.config.max_attempts)
