"""FABLE's forest builder: offline, the ``generator`` turns every document into a tree (``ForestBuilder``; the
data job ``overstory data fable-forest`` runs it resumably over a corpus and saves the ``Forest`` as JSON):

1. Semantic chunking. The document's sentences (the hierarchy's, with their token counts) are shown in windows of
   at most ``window_tokens``, numbered from 0; the model replies ``{"chunk_starts": [numbers]}``, the sentences
   where a new chunk begins. Sentence numbers are something a 135M model can write under a grammar (an integer
   range, never text to copy), and a chunk is then a run of whole sentences, so its character offsets are exact.
   An unusable reply (no list, or no number in range) falls back to packing each paragraph's sentences up to
   ``chunk_tokens``; an LLM chunk over ``max_chunk_tokens`` is re-packed, one under ``min_chunk_tokens`` joins a
   neighbour (``runs``). All are counted, the raw reply kept.
2. One typed tree per document, depth at most D (the root is at depth 1): root > section > subsection > leaf. A
   document with real headings (QASPER; ``seed_structure``) takes its sections and subsections from the hierarchy
   and is chunked inside them. Any other document whose leaves outnumber ``max_children`` is grouped by the model
   the same way (``{"group_starts": [...]}`` over its numbered leaves) into sections, and sections into
   subsections; a long document is grouped in parts of ``group_window`` leaves and the parts' sections are merged
   under the one root in document order. Groups of one leaf, and groups beyond ``max_children``, are merged with
   their neighbours while the size limit allows; a reply that leaves one group (or none usable) is split evenly
   (``balanced_runs``). Every internal node gets a table-of-contents title and a summary of its
   children (``{"title", "summary"}``; fallback: its first words and first sentence); the root's title is the
   document's, a seeded section's its heading.
3. Embeddings through the ``embedder``: an internal node embeds "toc path: summary", a leaf its content.

A request that failed for a transient reason (a timeout, a 5xx, after the client's retries) reads as an unusable
reply and is counted (``request_failures``; the data job then leaves the document for a rerun); an embedding
request that failed so raises its ``ClientError``. A request the server refuses (a 4xx other than 408 and 429: a
wrong role, a bad request) raises ``RequestRefused`` naming the role and the server's reason: every document would
fail alike, so the job stops instead of counting them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document, FailureRecord
from overstory.retrieval.arag import pack
from overstory.retrieval.fable.forest import KINDS, ForestNode
from overstory.retrieval.fable.replies import numbered, parse_summary
from overstory.retrieval.fable.runs import (
    balanced_runs,
    fallback_runs,
    merge_short_runs,
    parse_starts,
    runs_from_starts,
    split_long_runs,
)
from overstory.retrieval.strategy import raise_if_refused
from overstory.serving.client import Client, ClientError

EMBEDDER = "embedder"  # the role that embeds the nodes
FALLBACK_KINDS = ("chunk", "group", "summary")  # the replies that fall back (counted as ``<kind>_fallbacks``)


@dataclass(frozen=True)
class ForestConfig:
    """How the generator builds each document's tree (``ForestBuilder``)."""

    depth: int = 4  # D: leaves at depth <= D, the root at depth 1; 2 (root > leaves) to 4 (the paper's typed nodes)
    seed_structure: bool = True  # documents with headings (QASPER) take their sections from them
    window_tokens: int = 512  # sentences shown per chunking prompt: a few chunks' worth, a short CPU prefill
    chunk_tokens: int = 128  # the fallback packs a paragraph's sentences up to this many tokens
    max_chunk_tokens: int = 384  # an LLM chunk over this is re-packed to chunk_tokens (a leaf must fit B_max)
    # an LLM chunk under this joins a neighbour (within max_chunk_tokens): SmolLM2-135M starts a chunk at almost
    # every sentence, which leaves of 10-30 tokens; 0 keeps the model's chunks as they are
    min_chunk_tokens: int = 64
    max_children: int = 8  # a node with more leaves than this gets a level of groups, while the depth allows
    group_window: int = 24  # items per grouping prompt (long documents are grouped in parts); members per summary
    max_member_chars: int = 300  # each leaf's text is cut to this in grouping and summary prompts
    segment_max_tokens: int = 128  # reply tokens of a chunking or grouping call (a list of sentence numbers)
    summary_max_tokens: int = 160  # reply tokens of a summary call (a title and one or two sentences)
    embed_batch_size: int = 64

    def __post_init__(self) -> None:
        if not 2 <= self.depth <= len(KINDS):
            raise ConfigError(f"forest.depth must be between 2 and {len(KINDS)} (root, section, subsection, leaf), "
                              f"got {self.depth}")
        for key in ("window_tokens", "chunk_tokens", "max_chunk_tokens", "max_member_chars", "segment_max_tokens",
                    "summary_max_tokens", "embed_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"forest.{key} must be at least 1, got {getattr(self, key)}")
        if not 0 <= self.min_chunk_tokens <= self.max_chunk_tokens:
            raise ConfigError(f"forest.min_chunk_tokens must be between 0 and forest.max_chunk_tokens "
                              f"({self.max_chunk_tokens}), got {self.min_chunk_tokens}")
        if self.max_children < 2:
            raise ConfigError(f"forest.max_children must be at least 2, got {self.max_children}")
        if self.group_window < self.max_children:
            raise ConfigError(f"forest.group_window ({self.group_window}) must be at least forest.max_children "
                              f"({self.max_children})")


CHUNK_PROMPT = """Split the passage below into chunks. A chunk is a run of consecutive sentences about one topic \
that can be read on its own. The sentences are numbered.

{items}

Reply with JSON: {{"chunk_starts": [the numbers of the sentences that begin a chunk]}}. The first chunk begins at \
sentence 0."""

GROUP_PROMPT = """Below are consecutive parts of the document "{title}", numbered. Group them into sections: a \
section is a run of consecutive parts about one topic.

{items}

Reply with JSON: {{"group_starts": [the numbers of the parts that begin a section]}}. The first section begins at \
part 0."""

SUMMARY_PROMPT = """Below are the parts of {what} "{title}".

{items}

Write a table-of-contents title for it (at most 8 words) and a summary of what it covers (one or two sentences). \
Reply with JSON: {{"title": the title, "summary": the summary}}."""


def starts_response_format(key: str, n: int) -> dict:
    """``{key: [sentence or part numbers]}``, each within 0..n-1, at most n of them."""
    schema = {"type": "object", "required": [key], "properties": {key: {
        "type": "array", "minItems": 1, "maxItems": n, "items": {"type": "integer", "minimum": 0, "maximum": n - 1}}}}
    return {"type": "json_schema", "json_schema": {"name": key, "schema": schema}}


def summary_response_format(max_title_chars: int = 80, max_summary_chars: int = 300) -> dict:
    schema = {"type": "object", "required": ["title", "summary"], "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": max_title_chars},
        "summary": {"type": "string", "minLength": 1, "maxLength": max_summary_chars}}}
    return {"type": "json_schema", "json_schema": {"name": "node_summary", "schema": schema}}


def _first_words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


def _flat(text: str) -> str:
    """The text on one line, runs of whitespace as one space."""
    return " ".join(text.split())


@dataclass
class DocumentTree:
    """One document's built tree, what building it cost and the replies that had to fall back."""

    document: Document
    nodes: list[ForestNode]
    stats: Counter
    failures: list[FailureRecord]

    def record(self) -> dict[str, Any]:
        """The JSONL line the data job appends (``Forest.from_records`` reads it back)."""
        return {"id": self.document.id, "title": self.document.title, "text": self.document.text,
                "nodes": [asdict(n) for n in self.nodes], "stats": dict(self.stats)}


def fallback_counts(trees: Sequence[DocumentTree]) -> dict[str, int]:
    """How many chunk, group and summary replies fell back while ``trees`` were built, by kind (zeros included).

    >>> fallback_counts([DocumentTree(Document("d", "", "x"), [], Counter(summary_fallbacks=2), [])])
    {'chunk': 0, 'group': 0, 'summary': 2}
    """
    return {kind: sum(tree.stats[f"{kind}_fallbacks"] for tree in trees) for kind in FALLBACK_KINDS}


class _Build:
    """One document's working state: its sentences, its nodes so far, counts and failures."""

    def __init__(self, document: Document, hierarchy: Sequence[Chunk]):
        self.document = document
        self.hierarchy = [c for c in hierarchy if c.doc_id == document.id]
        self.sentences = sorted((c for c in self.hierarchy if c.level == "sentence"), key=lambda c: c.start)
        if not self.sentences:
            raise ValueError(f"the hierarchy has no sentences of document {document.id!r}")
        self.nodes: dict[str, ForestNode] = {}
        self.stats: Counter = Counter()
        self.failures: list[FailureRecord] = []

    def new(self, kind: str, parent: ForestNode | None, title: str = "") -> ForestNode:
        node_id = f"{self.document.id}#{kind}{self.stats['nodes_' + kind]}" if kind != "root" else \
            f"{self.document.id}#root"
        self.stats["nodes_" + kind] += 1
        node = ForestNode(node_id, self.document.id, kind, 1 if parent is None else parent.depth + 1,
                          None if parent is None else parent.id, [], 0, 0, 0, title=title)
        self.nodes[node_id] = node
        if parent is not None:
            parent.children.append(node_id)
        return node

    def text(self, node: ForestNode) -> str:
        return self.document.text[node.start:node.end]

    def toc_path(self, node: ForestNode) -> str:
        """Titles from the root down to ``node``."""
        path = [node]
        while path[-1].parent is not None:
            path.append(self.nodes[path[-1].parent])
        return " > ".join(n.title for n in reversed(path))

    def fail(self, record_id: str, what: str, raw: str) -> None:
        self.stats[f"{what}_fallbacks"] += 1
        self.failures.append(FailureRecord(id=record_id, job="fable forest", error=f"unusable {what} reply",
                                           raw=raw, attempts=1))


class ForestBuilder:
    """Builds one document's tree with the served ``generator`` and ``embedder`` (see the module docstring).

    Every LLM call is made once at temperature 0 (asking again would get the same reply; the client already
    retries failed requests): an unusable reply falls back at once, is counted under ``<what>_fallbacks`` and kept
    with its raw text as a ``FailureRecord``. Thread-safe across documents: the data job builds several at once."""

    def __init__(self, client: Client, config: ForestConfig | None = None, role: str = "generator"):
        self.client, self.config, self.role = client, config or ForestConfig(), role

    def build(self, document: Document, hierarchy: Sequence[Chunk]) -> DocumentTree:
        """The tree of ``document``; ``hierarchy`` holds its chunks (``build_hierarchies``: sentences with token
        counts, and sections where the document has headings), other documents' chunks are ignored."""
        state = _Build(document, hierarchy)
        root = state.new("root", None, title=document.title)
        scopes = self._seeded_scopes(state, root)
        state.stats["seeded"] = int(bool(scopes))
        for parent, sentences in scopes or [(root, state.sentences)]:
            self._chunk(state, parent, sentences)
        if not scopes:
            self._group(state, root)
        self._set_spans(state, root)
        self._summarise(state, root)
        self._embed(state)
        return DocumentTree(document, list(state.nodes.values()), state.stats, state.failures)

    # ---- structure

    def _seeded_scopes(self, state: _Build, root: ForestNode) -> list[tuple[ForestNode, list[Chunk]]]:
        """Sections (and subsections, at depth 4) from the document's headings, each with the sentences it holds;
        [] when the document has no headings, seeding is off or the depth leaves no room for sections."""
        headings = state.document.metadata.get("headings") or []
        if not (self.config.seed_structure and headings and self.config.depth >= 3):
            return []
        titles = {start: title for _, title, start, _ in headings}
        by_id = {c.id: c for c in state.hierarchy}
        scopes = []
        for section in sorted((c for c in state.hierarchy if c.level == "section"), key=lambda c: c.start):
            node = state.new("section", root, title=titles.get(section.start, ""))
            parts = [by_id[i] for i in section.children]
            if self.config.depth < 4 or len(parts) < 2:
                parts, parent_of = [section], {section.id: node}
            else:
                parent_of = {p.id: state.new("subsection", node, title=titles.get(p.start, "")) for p in parts}
            scopes += [(parent_of[p.id], [s for s in state.sentences if p.start <= s.start and s.end <= p.end])
                       for p in parts]
        return scopes

    def _group(self, state: _Build, parent: ForestNode) -> None:
        """Group ``parent``'s leaves into sections (then a section's into subsections) while they outnumber
        ``max_children`` and the depth allows; in parts of ``group_window`` leaves, merged in document order. A
        group holds at most ``max_children`` leaves per level still to come below it (a section that will get
        subsections up to max_children^2): a longer run in a reply is re-packed; an unusable reply, or one that puts
        every leaf in one group, gets ``balanced_runs``."""
        kind = KINDS[parent.depth]  # the kind one level below the parent
        leaves = [state.nodes[c] for c in parent.children]
        if len(leaves) <= self.config.max_children or parent.depth + 2 > self.config.depth:
            return
        size = self.config.max_children ** (self.config.depth - parent.depth - 1)
        runs: list[range] = []
        for part in pack([1] * len(leaves), self.config.group_window):
            members = [_flat(state.text(n))[: self.config.max_member_chars] for n in leaves[part.start:part.stop]]
            prompt = GROUP_PROMPT.format(title=state.document.title, items=numbered(members))
            ones = [1] * len(members)
            found, _ = self._segment(state, "group", prompt, "group_starts", ones, size, size,
                                     partial(balanced_runs, len(ones), self.config.max_children, size),
                                     f"{parent.id}/group{part.start}")
            runs += [range(part.start + r.start, part.start + r.stop) for r in found]
        # a group of one leaf is a node without a purpose, and more groups than max_children leave the parent as
        # wide as before: the model's groups are merged (in document order) until neither holds or none fits
        runs, merged = merge_short_runs(runs, [1] * len(leaves), size, min_weight=2,
                                        max_runs=self.config.max_children)
        state.stats["group_runs_merged"] += merged
        if len(runs) == 1:  # every leaf in one group: a section that only repeats its parent; split it evenly instead
            runs = balanced_runs(len(leaves), self.config.max_children, size)
            state.stats["group_runs_rebalanced"] += 1
        parent.children = []
        for run in runs:
            group = state.new(kind, parent)
            for leaf in leaves[run.start:run.stop]:
                leaf.parent = group.id
                group.children.append(leaf.id)
        for child in [state.nodes[c] for c in parent.children]:
            self._group(state, child)

    # ---- chunking

    def _chunk(self, state: _Build, parent: ForestNode, sentences: list[Chunk]) -> None:
        """Leaves under ``parent`` from ``sentences``, window by window."""
        tokens = [s.n_tokens for s in sentences]
        for window in pack(tokens, self.config.window_tokens):
            members, weights = sentences[window.start:window.stop], tokens[window.start:window.stop]
            prompt = CHUNK_PROMPT.format(items=numbered([_flat(s.text) for s in members]))
            runs, source = self._segment(
                state, "chunk", prompt, "chunk_starts", weights, self.config.max_chunk_tokens, self.config.chunk_tokens,
                partial(fallback_runs, weights, [s.parent or "" for s in members], self.config.chunk_tokens),
                f"{parent.id}/chunk{window.start}")
            if source == "llm":
                runs, merged = merge_short_runs(runs, weights, self.config.max_chunk_tokens,
                                                min_weight=self.config.min_chunk_tokens)
                state.stats["chunk_runs_merged"] += merged
            for run in runs:
                leaf = state.new("leaf", parent)
                leaf.start, leaf.end = members[run.start].start, members[run.stop - 1].end
                leaf.n_tokens, leaf.source = sum(weights[run.start:run.stop]), source

    def _segment(self, state: _Build, what: str, prompt: str, key: str, weights: list[int], limit: int, size: int,
                 fallback: Callable[[], list[range]], record_id: str) -> tuple[list[range], str]:
        """(runs of the numbered items as the model splits them, runs over ``limit`` re-packed to ``size``; "llm"),
        or (the ``fallback``'s runs; "fallback") when the reply is unusable. A single item needs no call."""
        if len(weights) == 1:
            return [range(0, 1)], "llm"
        raw = self._ask(state, what, prompt, starts_response_format(key, len(weights)), self.config.segment_max_tokens)
        parsed = parse_starts(raw, key, len(weights))
        if parsed is None:
            state.fail(record_id, what, raw)
            return fallback(), "fallback"
        starts, dropped = parsed
        runs, split = split_long_runs(runs_from_starts(starts, len(weights)), weights, limit, size)
        state.stats[f"{what}_ids_dropped"] += dropped
        state.stats[f"{what}_runs_split"] += split
        return runs, "llm"

    def _ask(self, state: _Build, what: str, prompt: str, response_format: dict, max_tokens: int) -> str:
        """The reply's text; a transiently failed request reads as an unusable reply (it falls back, its error kept
        as raw, counted under ``request_failures``); a refused one raises ``RequestRefused``."""
        state.stats[f"{what}_calls"] += 1
        try:
            return self.client.chat(self.role, [{"role": "user", "content": prompt}], response_format=response_format,
                                    max_tokens=max_tokens, temperature=0).text
        except ClientError as exc:
            raise_if_refused(exc, f"FABLE's forest {what} request (role {self.role!r})")
            state.stats["request_failures"] += 1
            return f"<request failed: {exc}>"

    # ---- summaries and embeddings

    def _set_spans(self, state: _Build, node: ForestNode) -> None:
        """An internal node spans its first to its last leaf; its tokens are its children's. Depths follow."""
        for child_id in node.children:
            child = state.nodes[child_id]
            child.depth = node.depth + 1
            if child.children:
                self._set_spans(state, child)
        if node.children:
            children = [state.nodes[c] for c in node.children]
            node.start, node.end = children[0].start, children[-1].end
            node.n_tokens = sum(c.n_tokens for c in children)

    def _summarise(self, state: _Build, node: ForestNode) -> None:
        """Titles and summaries bottom-up: a node reads its children (leaves' text, internal children's summaries)."""
        children = [state.nodes[c] for c in node.children]
        for child in children:
            if child.kind != "leaf":
                self._summarise(state, child)
        members = [f"{c.title}: {c.summary}" if c.kind != "leaf" else _flat(state.text(c))
                   for c in children[: self.config.group_window]]
        what = f'the document "{state.document.title}"' if node.kind == "root" else \
            f'a {node.kind} of the document "{state.document.title}"'
        prompt = SUMMARY_PROMPT.format(what=what, title=node.title or state.document.title,
                                       items=numbered([m[: self.config.max_member_chars] for m in members]))
        raw = self._ask(state, "summary", prompt, summary_response_format(), self.config.summary_max_tokens)
        parsed = parse_summary(raw)
        node.source = "llm" if parsed else "fallback"
        if parsed is None:
            state.fail(f"{node.id}/summary", "summary", raw)
            first = next(s for s in state.sentences if s.start >= node.start)
            parsed = (_first_words(state.text(node), 8), _flat(first.text)[:300])
        node.title, node.summary = node.title or parsed[0], parsed[1]

    def _embed(self, state: _Build) -> None:
        """Internal nodes embed "toc path: summary", leaves their content. A failed request raises: its
        ``ClientError`` when transient, ``RequestRefused`` when refused."""
        nodes = list(state.nodes.values())
        texts = [state.text(n) if n.kind == "leaf" else f"{state.toc_path(n)}: {n.summary}" for n in nodes]
        size = self.config.embed_batch_size
        for i in range(0, len(nodes), size):
            try:
                vectors = self.client.embed(EMBEDDER, texts[i:i + size])
            except ClientError as exc:
                raise_if_refused(exc, f"FABLE's forest embeddings (role {EMBEDDER!r})")
                raise
            for node, vector in zip(nodes[i:i + size], vectors):
                node.embedding = [round(float(x), 6) for x in vector]
