"""FABLE (arXiv 2601.18116, "Forest-based Adaptive Bi-path LLM-Enhanced retrieval") as a retrieval strategy.

Offline, the ``generator`` turns every document into a tree (``retrieval.fable_builder.ForestBuilder``; the data job
``overstory data fable-forest`` runs it resumably over a corpus and saves the ``Forest`` as JSON):

1. Semantic chunking. The document's sentences (the hierarchy's, with their token counts) are shown in windows of
   at most ``window_tokens``, numbered from 0; the model replies ``{"chunk_starts": [numbers]}``, the sentences
   where a new chunk begins. Sentence numbers are something a 135M model can write under a grammar (an integer
   range, never text to copy), and a chunk is then a run of whole sentences, so its character offsets are exact.
   An unusable reply (no list, or no number in range) falls back to packing each paragraph's sentences up to
   ``chunk_tokens``; an LLM chunk over ``max_chunk_tokens`` is re-packed, one under ``min_chunk_tokens`` joins a
   neighbour (``retrieval/fable_runs.py``). All are counted, the raw reply kept.
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

Online, ``FableStrategy.answer`` runs the paper's Algorithm 1:

- Document level, bi-path: the model picks from a numbered list of the non-leaf nodes of depth <= L (root and,
  at L = 2, sections: title path and summary) -> the documents of the ids it names (ids out of range are dropped and
  counted); and vector top-K over every node of the forest, aggregated to documents by their best node. Fused:
  the LLM's documents first, then the vector path's, deduplicated.
- If the fused documents fit the budget B_max (tokens) they are returned whole. Otherwise, node level, bi-path:
  the model navigates the non-leaf nodes of those documents (same list and reply shape), and TreeExpansion scores
  every node of them (``tree_expansion_scores``) and takes nodes greedily by score within B_max
  (``greedy_select``). NodeFusion (``node_fusion``) drops the nodes whose ancestor is kept and orders the rest by
  document (the fused order: LLM-chosen documents first), then by position in the document. Budget control keeps
  the longest prefix of that order within B_max (``budget_prefix``).
- The generator answers from the returned nodes with the shared answer prompt (``generate_answer``), every node
  read whole (the budget, not the answer config's chunk count, bounds the context). A question longer than
  ``max_question_chars`` is cut for the embedding and every prompt (``question_truncated`` in the details).

Deviation from the paper: its questions come with their own small document set; here the forest covers a whole
corpus (hundreds of documents), which no small generator can read in one prompt. The document-level LLM path is
therefore shown the ``llm_candidates`` documents the vector path ranks highest (in corpus order, so the ranking
is not leaked by position); with a per-question corpus of at most that many documents it sees them all, as in the
paper. Selection prompts list at most ``llm_max_nodes`` nodes.

Budget when nothing fits (B_max below the first document, or below every node the paths would return): the best
candidate (the first document; at node level the LLM's first pick, else the best TreeExpansion score) is cut to
B_max tokens, at its own characters per token with exact offsets, rather than leaving an empty context: the
generator reads the best evidence there is and ``budget_truncations`` says it happened. At node level an LLM pick
larger than B_max is otherwise left out (``oversized_selections``). B_max <= 0 is a config error.

Configs: the forest is built by ``configs/data/fable_forest.yaml``; the strategy runs in the evaluation harness.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document
from overstory.models.json_reply import as_int, json_objects, loads_tolerant
from overstory.retrieval.naive import AnswerConfig, generate_answer
from overstory.retrieval.strategy import StrategyAnswer
from overstory.serving.client import Client, ClientError

FORMAT = "fable-forest"
FORMAT_VERSION = 1
KINDS = ("root", "section", "subsection", "leaf")  # top to bottom; a group made under a node of depth d is KINDS[d]
LEVEL_OF_KIND = {"root": "document", "section": "section", "subsection": "subsection", "leaf": "paragraph"}
# The paper's Table 1 variants, and "fable" for the full adaptive algorithm:
#   llm-docs: documents the LLM selects, returned whole;      docs: document-level bi-path, returned whole;
#   llm-nodes / treexp-nodes / nodes: document-level bi-path, then node level by LLM navigation only, TreeExpansion
#   only, or both, whatever the documents' size;              fable: whole documents when they fit B_max, else nodes.
MODES = ("fable", "llm-docs", "docs", "llm-nodes", "treexp-nodes", "nodes")
DOCUMENT_MODES = ("llm-docs", "docs")


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


@dataclass(frozen=True)
class FableConfig:
    """How FABLE retrieves. The paper leaves L, K and B_max open (B_max from 1K to 128K tokens, 8K generator input
    in its headline results); these defaults suit the built-in SmolLM2-135M generator."""

    mode: str = "fable"  # one of MODES
    # B_max: the paper's smallest budget. SmolLM2-135M has an 8K context, but its answers degrade long before that
    # and a CPU prefill grows with every token; 1K tokens hold 6-8 HotpotQA paragraphs or 2-3 QASPER sections.
    budget_tokens: int = 1024
    # L: the root and its sections tell what a document covers; deeper levels (QASPER's subsections) triple the
    # list the LLM reads at the document level, past what the 135M model follows in one prompt.
    llm_depth: int = 2
    # K: nodes (not documents) from the vector path; several nodes of one document count once, so 10 nodes give a
    # handful of documents, about what fits B_max whole.
    top_k: int = 10
    llm_candidates: int = 10  # documents the document-level LLM path is shown (the vector path's best; see above)
    llm_max_nodes: int = 40  # lines of one selection prompt (titles and summaries): about 2K tokens
    llm_max_selected: int = 4  # ids one selection reply may name
    max_summary_chars: int = 200  # each node's summary is cut to this in selection prompts
    max_tokens: int = 48  # reply tokens of a selection call
    max_question_chars: int = 2000  # a longer question is cut (every prompt must fit the generator's context)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"fable.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for key in ("budget_tokens", "llm_depth", "top_k", "llm_candidates", "llm_max_nodes", "llm_max_selected",
                    "max_summary_chars", "max_tokens", "max_question_chars"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fable.{key} must be at least 1, got {getattr(self, key)}")


# ------------------------------------------------------------------------------------------------- the forest


@dataclass
class ForestNode:
    """One node of a document's tree. ``start``/``end`` are character offsets into the document (an internal node
    spans its descendants), so any node can be returned as a Chunk; ``n_tokens`` sums its sentences' tokens."""

    id: str
    doc_id: str
    kind: str  # root, section, subsection, leaf
    depth: int  # the root is at depth 1
    parent: str | None
    children: list[str]
    start: int
    end: int
    n_tokens: int
    title: str = ""  # internal nodes: the table-of-contents title
    summary: str = ""  # internal nodes: what the descendants cover
    source: str = ""  # "llm" or "fallback": where the leaf's boundaries or the node's summary came from
    embedding: list[float] = field(default_factory=list)


class Forest:
    """The trees of a corpus: documents (their text, so nodes read without the corpus) and nodes by id."""

    def __init__(self, documents: Sequence[Document], nodes: Iterable[ForestNode], meta: dict[str, Any] | None = None):
        self.documents = {d.id: d for d in documents}
        self.nodes = {n.id: n for n in nodes}
        self.meta = meta or {}
        self.roots = {n.doc_id: n.id for n in self.nodes.values() if n.kind == "root"}
        missing = [d for d in self.documents if d not in self.roots]
        if missing:
            raise ValueError(f"forest: document {missing[0]!r} has no root node")
        self.ids = list(self.nodes)
        self.position = {node_id: i for i, node_id in enumerate(self.ids)}  # forest order breaks score ties
        vectors = np.array([self.nodes[i].embedding for i in self.ids], dtype=np.float32).reshape(len(self.ids), -1) \
            if self.ids else np.zeros((0, 0), dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.matrix = vectors / np.where(norms == 0, 1.0, norms)

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], meta: dict[str, Any] | None = None) -> Forest:
        """From per-document records (``DocumentTree.record``, the data job's JSONL lines)."""
        records = list(records)
        documents = [Document(r["id"], r["title"], r["text"]) for r in records]
        return cls(documents, [ForestNode(**n) for r in records for n in r["nodes"]], meta)

    def records(self) -> list[dict[str, Any]]:
        """One record per document, in document order: what ``save`` writes and ``from_records`` reads."""
        by_doc: dict[str, list[dict[str, Any]]] = {d: [] for d in self.documents}
        for node in self.nodes.values():
            by_doc[node.doc_id].append(asdict(node))
        return [{"id": d.id, "title": d.title, "text": d.text, "nodes": by_doc[d.id]} for d in self.documents.values()]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "meta": self.meta,
                                   "documents": self.records()}, ensure_ascii=False))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Forest:
        data = json.loads(Path(path).read_text())
        if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path}: not a {FORMAT} file of version {FORMAT_VERSION}")
        return cls.from_records(data["documents"], data.get("meta"))

    def chunk(self, node_id: str) -> Chunk:
        """The node as a Chunk of its document (level: document, section, subsection or paragraph for a leaf)."""
        node, document = self.nodes[node_id], self.documents[self.nodes[node_id].doc_id]
        return Chunk(id=node.id, doc_id=node.doc_id, level=LEVEL_OF_KIND[node.kind],
                     text=document.text[node.start:node.end], parent=node.parent, children=list(node.children),
                     start=node.start, end=node.end, n_tokens=node.n_tokens, title=document.title)

    def ancestors(self, node_id: str) -> list[str]:
        """Ids from the parent up to the root."""
        out, parent = [], self.nodes[node_id].parent
        while parent is not None:
            out.append(parent)
            parent = self.nodes[parent].parent
        return out

    def subtree(self, node_id: str) -> list[str]:
        """The node and its descendants, pre-order (document order)."""
        out, stack = [], [node_id]
        while stack:
            out.append(stack.pop())
            stack.extend(reversed(self.nodes[out[-1]].children))
        return out

    def toc_path(self, node_id: str) -> str:
        return " > ".join(self.nodes[i].title for i in [*reversed(self.ancestors(node_id)), node_id])

    def similarities(self, vector: Sequence[float]) -> dict[str, float]:
        """Cosine of every node's embedding with ``vector``."""
        query = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(query))
        scores = self.matrix @ (query / (norm or 1.0))
        return dict(zip(self.ids, scores.tolist()))


# ------------------------------------------------------------------------------------------- pure functions


def tree_expansion_scores(forest: Forest, doc_ids: Iterable[str], cosine: dict[str, float]) -> dict[str, float]:
    """TreeExpansion's S(v) = (S_sim(v) + S_inh(v) + S_child(v)) / 3 for every node of ``doc_ids``, where
    S_sim(v) = cos(q, v) / depth(v) with the root at depth 1, S_inh(v) = the largest S_sim of v's ancestors, and
    S_child(v) = the mean S of v's children. Conventions: the root has no ancestors, so S_inh(root) = 0; a leaf has
    no children, so S_child(leaf) = 0. The divisor stays 3 for every node (the formula as written: an empty term
    adds nothing), which keeps all scores on one scale; an internal node therefore outscores a leaf of the same
    similarity and inheritance, and is taken when it fits the budget: it returns its leaves in context.

    >>> forest = Forest([Document("d", "D", "ab")], [
    ...     ForestNode("r", "d", "root", 1, None, ["l"], 0, 2, 2), ForestNode("l", "d", "leaf", 2, "r", [], 0, 2, 2)])
    >>> {k: round(v, 4) for k, v in tree_expansion_scores(forest, ["d"], {"r": 0.6, "l": 0.8}).items()}
    {'l': 0.3333, 'r': 0.3111}
    """
    scores: dict[str, float] = {}

    def score(node_id: str, inherited: float | None) -> float:
        node = forest.nodes[node_id]
        s_sim = cosine[node_id] / node.depth
        below = s_sim if inherited is None else max(inherited, s_sim)
        children = [score(child, below) for child in node.children]
        s_child = sum(children) / len(children) if children else 0.0
        scores[node_id] = (s_sim + (inherited or 0.0) + s_child) / 3
        return scores[node_id]

    for doc_id in doc_ids:
        score(forest.roots[doc_id], None)
    return scores


def greedy_select(forest: Forest, scores: dict[str, float], budget: int) -> list[str]:
    """TreeExpansion's selection: nodes by score (ties: the shallower, i.e. the ancestor, first; then document
    order), each taken if no ancestor of it is taken and it fits what is left of ``budget`` tokens; taking a node
    drops its taken descendants (it covers them) and gives their tokens back. Returns the taken ids, best first.

    >>> forest = Forest([Document("d", "D", "abcd")], [ForestNode("r", "d", "root", 1, None, ["a", "b"], 0, 4, 10),
    ...     ForestNode("a", "d", "leaf", 2, "r", [], 0, 2, 6), ForestNode("b", "d", "leaf", 2, "r", [], 2, 4, 4)])
    >>> scores = {"a": 0.9, "b": 0.5, "r": 0.4}
    >>> greedy_select(forest, scores, 10), greedy_select(forest, scores, 8)
    (['r'], ['a'])
    """
    ranked = sorted(scores, key=lambda n: (-scores[n], forest.nodes[n].depth, forest.position[n]))
    taken: list[str] = []
    used = 0
    for node_id in ranked:
        if any(a in taken for a in forest.ancestors(node_id)):
            continue
        covered = [t for t in taken if node_id in forest.ancestors(t)]
        cost = forest.nodes[node_id].n_tokens - sum(forest.nodes[t].n_tokens for t in covered)
        if used + cost <= budget:
            taken = [t for t in taken if t not in covered] + [node_id]
            used += cost
    return taken


def node_fusion(forest: Forest, node_ids: Iterable[str], doc_order: Sequence[str]) -> list[str]:
    """NodeFusion: the union of both paths' nodes without duplicates and without any node whose ancestor is in it,
    ordered by document (``doc_order``: the LLM's documents first) and within a document by position.

    >>> forest = Forest([Document("d", "D", "abcd"), Document("e", "E", "x")], [
    ...     ForestNode("r", "d", "root", 1, None, ["a", "b"], 0, 4, 4),
    ...     ForestNode("a", "d", "leaf", 2, "r", [], 0, 2, 2), ForestNode("b", "d", "leaf", 2, "r", [], 2, 4, 2),
    ...     ForestNode("s", "e", "root", 1, None, [], 0, 1, 1)])
    >>> node_fusion(forest, ["b", "a", "s", "b"], ["e", "d"]), node_fusion(forest, ["a", "r", "s"], ["d", "e"])
    (['s', 'a', 'b'], ['r', 's'])
    """
    kept = set(node_ids)
    kept = {n for n in kept if not kept.intersection(forest.ancestors(n))}
    rank = {doc_id: i for i, doc_id in enumerate(doc_order)}
    return sorted(kept, key=lambda n: (rank.get(forest.nodes[n].doc_id, len(rank)), forest.nodes[n].start,
                                       forest.nodes[n].depth))


def budget_prefix(n_tokens: Sequence[int], budget: int) -> int:
    """How many of the ordered nodes budget control keeps: the longest prefix whose tokens sum to at most
    ``budget`` (a node that does not fit ends the list; later, smaller nodes are not slipped in after it).

    >>> budget_prefix([50, 30, 40], 85), budget_prefix([50, 40, 10], 60), budget_prefix([90], 60)
    (2, 1, 0)
    """
    total = 0
    for i, n in enumerate(n_tokens):
        total += n
        if total > budget:
            return i
    return len(n_tokens)


def fuse_documents(llm_docs: Sequence[str], vector_docs: Sequence[str]) -> list[str]:
    """The document-level fusion: the LLM's documents first, then the vector path's, each once.

    >>> fuse_documents(["b", "a"], ["a", "c", "b"])
    ['b', 'a', 'c']
    """
    return list(dict.fromkeys([*llm_docs, *vector_docs]))


def vector_documents(forest: Forest, cosine: dict[str, float], top_k: int) -> list[str]:
    """Documents of the ``top_k`` nodes most similar to the query, by their best node (max aggregation)."""
    best = sorted(cosine, key=lambda n: (-cosine[n], forest.position[n]))[:top_k]
    return list(dict.fromkeys(forest.nodes[n].doc_id for n in best))


def _reply_list(text: str, key: str) -> list[Any] | None:
    """The list under ``key`` in the last JSON object of the reply that has one (a bare number is a list of one)."""
    for obj in map(loads_tolerant, reversed(json_objects(text))):
        if obj is not None and key in obj:
            value = obj[key]
            return value if isinstance(value, list) else [value]
    return None


def parse_ids(text: str, key: str, n: int) -> tuple[list[int], int] | None:
    """(the numbers 0..n-1 the reply lists under ``key``, in its order and once each; how many listed items were
    not such a number: hallucinated ids), or None when the reply holds no such list.

    >>> parse_ids('Sure: {"ids": [2, "0", 9, 2, "x"]}', "ids", 3), parse_ids("no json", "ids", 3)
    (([2, 0], 2), None)
    """
    items = _reply_list(text, key)
    if items is None:
        return None
    numbers = [as_int(item) for item in items]
    valid = [i for i in numbers if i is not None and 0 <= i < n]
    return list(dict.fromkeys(valid)), len(numbers) - len(valid)


def parse_summary(text: str) -> tuple[str, str] | None:
    """(title, summary) from the last reply object with both non-empty, else None.

    >>> parse_summary('{"title": " Rivers ", "summary": "Two rivers."}'), parse_summary('{"title": "", "summary": "x"}')
    (('Rivers', 'Two rivers.'), None)
    """
    for obj in map(loads_tolerant, reversed(json_objects(text))):
        if obj is None:
            continue
        title, summary = " ".join(str(obj.get("title", "")).split()), " ".join(str(obj.get("summary", "")).split())
        if title and summary:
            return title, summary
    return None


# ---------------------------------------------------------------------------------------- prompts and schemas

SELECT_PROMPT = """Question: {question}

Below is the table of contents of {what}: numbered titles with summaries. Choose the lines most likely to hold the \
answer.

{items}

Reply with JSON: {{"ids": [the numbers of at most {k} lines]}}."""


def selection_response_format(n: int, max_items: int) -> dict:
    """``{"ids": [line numbers]}``: 1 to ``max_items`` of 0..n-1 (a constrained decoder cannot invent an id; an
    unconstrained server may, and those are dropped and counted)."""
    schema = {"type": "object", "required": ["ids"], "properties": {"ids": {
        "type": "array", "minItems": 1, "maxItems": max_items,
        "items": {"type": "integer", "minimum": 0, "maximum": n - 1}}}}
    return {"type": "json_schema", "json_schema": {"name": "selection", "schema": schema}}


def numbered(texts: Sequence[str]) -> str:
    """One line per text, each after its number in brackets: how every prompt lists what the model picks from."""
    return "\n".join(f"[{i}] {text}" for i, text in enumerate(texts))


# ------------------------------------------------------------------------------------------------- strategy


# the problems counted for every question (the harness sums names ending in _unparsed or _failures)
PROBLEMS = ("documents_selection_unparsed", "documents_selection_id_failures", "nodes_selection_unparsed",
            "nodes_selection_id_failures", "request_failures")


@dataclass
class _Question:
    """One question's retrieval so far: the problem counts the harness sums, and the raw replies behind them."""

    counts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(PROBLEMS, 0)))
    unparsed: list[dict[str, str]] = field(default_factory=list)


class FableStrategy:
    """FABLE over a forest: ``build`` makes one with the generator and embedder, ``load`` reads a saved one."""

    def __init__(self, forest: Forest, config: FableConfig | None = None, answer: AnswerConfig | None = None):
        if not forest.documents:
            raise ConfigError("fable: the forest has no documents")
        self.forest, self.config, self.answer_config = forest, config or FableConfig(), answer or AnswerConfig()
        self.name = "fable" if self.config.mode == "fable" else f"fable-{self.config.mode}"

    @classmethod
    def build(cls, documents: Sequence[Document], hierarchy: Sequence[Chunk], client: Client,
              forest: ForestConfig | None = None, config: FableConfig | None = None,
              answer: AnswerConfig | None = None) -> FableStrategy:
        """Build every document's tree through ``client`` (``hierarchy``: ``build_hierarchies(documents, ...)``)."""
        from overstory.retrieval.fable_builder import ForestBuilder  # it builds on this module's forest

        builder = ForestBuilder(client, forest)
        trees = [builder.build(document, hierarchy) for document in documents]
        return cls(Forest.from_records([t.record() for t in trees], {"forest": asdict(builder.config)}), config, answer)

    @classmethod
    def load(cls, forest_path: str | Path, config: FableConfig | None = None,
             answer: AnswerConfig | None = None) -> FableStrategy:
        """The strategy over a forest saved by ``overstory data fable-forest`` (``<out>/forest.json``)."""
        return cls(Forest.load(forest_path), config, answer)

    def answer(self, question: str, client: Client) -> StrategyAnswer:
        """Retrieve (Algorithm 1) and answer from the returned nodes; never raises for a bad reply or request."""
        asked = question[: self.config.max_question_chars]
        try:
            evidence, details = self.retrieve(asked, client)
        except ClientError as exc:  # the question could not be embedded: there is nothing to retrieve with
            return StrategyAnswer("", "", failure="request_failed", failure_detail=str(exc),
                                  details={"mode": self.config.mode, "request_failures": 1})
        details["question_truncated"] = len(asked) < len(question)
        read = AnswerConfig(max_tokens=self.answer_config.max_tokens, context_chunks=len(evidence),
                            max_chunk_chars=max((len(c.text) for c in evidence), default=1))
        return generate_answer(asked, evidence, client, read, **details)

    def retrieve(self, question: str, client: Client) -> tuple[list[Chunk], dict[str, Any]]:
        """The nodes to read, in reading order, within the budget, and what the retrieval did (``details``).
        Only a failed query embedding raises (ClientError); a failed or unusable selection call leaves that path
        empty and is counted."""
        config, forest, state = self.config, self.forest, _Question()
        cosine = forest.similarities(client.embed("embedder", [question])[0])
        vector_docs = vector_documents(forest, cosine, config.top_k)
        llm_docs = self._select_documents(question, cosine, client, state)
        fused = llm_docs if config.mode == "llm-docs" else fuse_documents(llm_docs, vector_docs)
        doc_tokens = sum(forest.nodes[forest.roots[d]].n_tokens for d in fused)
        details: dict[str, Any] = {"mode": config.mode, "llm_documents": llm_docs, "vector_documents": vector_docs,
                                   "documents": fused, "budget": config.budget_tokens}
        if config.mode in DOCUMENT_MODES or (config.mode == "fable" and doc_tokens <= config.budget_tokens):
            details["route"], ordered = "documents", [forest.roots[d] for d in fused]
        else:
            details["route"], ordered = "nodes", self._node_level(question, fused, cosine, client, state, details)
        evidence = self._within_budget(ordered, state)
        details.update(nodes=[c.id for c in evidence], tokens=sum(c.n_tokens for c in evidence), **state.counts,
                       unparsed_replies=state.unparsed)
        return evidence, details

    def _node_level(self, question: str, fused: list[str], cosine: dict[str, float], client: Client,
                    state: _Question, details: dict[str, Any]) -> list[str]:
        """Node level, bi-path: LLM navigation and TreeExpansion over the fused documents, then NodeFusion. An LLM
        pick larger than the whole budget could never be returned and is left out (``oversized_selections``);
        when no node fits at all, the best candidate (the LLM's first pick, else the best score) is kept alone, to
        be cut to the budget."""
        config, forest = self.config, self.forest
        chosen = [] if config.mode == "treexp-nodes" else self._navigate(question, fused, client, state)
        fitting = [n for n in chosen if forest.nodes[n].n_tokens <= config.budget_tokens]
        state.counts["oversized_selections"] += len(chosen) - len(fitting)
        scores = {} if config.mode == "llm-nodes" else tree_expansion_scores(forest, fused, cosine)
        treexp = greedy_select(forest, scores, config.budget_tokens)
        details.update(llm_nodes=fitting, treexp_nodes=treexp)
        return node_fusion(forest, fitting + treexp, fused) or (chosen + sorted(scores, key=lambda n: -scores[n]))[:1]

    # ---- the LLM path

    def _select_documents(self, question: str, cosine: dict[str, float], client: Client, state: _Question
                          ) -> list[str]:
        """Document level: the LLM picks among the non-leaf nodes of depth <= L of the candidate documents."""
        best: dict[str, float] = {}
        for node_id, value in cosine.items():
            doc_id = self.forest.nodes[node_id].doc_id
            best[doc_id] = max(best.get(doc_id, value), value)
        corpus_order = list(self.forest.documents)
        candidates = set(sorted(corpus_order, key=lambda d: -best[d])[: self.config.llm_candidates])
        shown = [n for d in corpus_order if d in candidates for n in self.forest.subtree(self.forest.roots[d])
                 if self.forest.nodes[n].kind != "leaf" and self.forest.nodes[n].depth <= self.config.llm_depth]
        chosen = self._select(question, "documents", shown, client, state)
        return list(dict.fromkeys(self.forest.nodes[n].doc_id for n in chosen))

    def _navigate(self, question: str, doc_ids: Sequence[str], client: Client, state: _Question) -> list[str]:
        """Node level: the LLM picks among every non-leaf node of the selected documents."""
        shown = [n for d in doc_ids for n in self.forest.subtree(self.forest.roots[d])
                 if self.forest.nodes[n].kind != "leaf"]
        return self._select(question, "nodes", shown, client, state)

    def _select(self, question: str, step: str, node_ids: list[str], client: Client, state: _Question) -> list[str]:
        """One selection call over ``node_ids`` (the first ``llm_max_nodes``, numbered): the ids it names, in its
        order. An unusable reply counts under ``<step>_selection_unparsed``, ids out of range under
        ``<step>_selection_id_failures``, a failed request under ``request_failures``; ``<step>_nodes_hidden`` says
        how many nodes the prompt had no room for."""
        shown = node_ids[: self.config.llm_max_nodes]
        state.counts[f"{step}_nodes_hidden"] = len(node_ids) - len(shown)
        if not shown:
            return []
        lines = [f"{'  ' * (self.forest.nodes[n].depth - 1)}{self.forest.toc_path(n)}: "
                 f"{self.forest.nodes[n].summary[: self.config.max_summary_chars]}" for n in shown]
        what = "documents (with their main sections)" if step == "documents" else "the selected documents"
        prompt = SELECT_PROMPT.format(question=question, what=what, items=numbered(lines),
                                      k=self.config.llm_max_selected)
        try:
            raw = client.chat("generator", [{"role": "user", "content": prompt}], max_tokens=self.config.max_tokens,
                              temperature=0, response_format=selection_response_format(
                                  len(shown), self.config.llm_max_selected)).text
        except ClientError as exc:
            state.counts["request_failures"] += 1
            state.unparsed.append({"step": step, "raw": f"<request failed: {exc}>"})
            return []
        parsed = parse_ids(raw, "ids", len(shown))
        if parsed is None:
            state.counts[f"{step}_selection_unparsed"] += 1
            state.unparsed.append({"step": step, "raw": raw})
            return []
        state.counts[f"{step}_selection_id_failures"] += parsed[1]
        return [shown[i] for i in parsed[0]]

    # ---- budget

    def _within_budget(self, ordered: list[str], state: _Question) -> list[Chunk]:
        """The budget's prefix of ``ordered`` as chunks; when not even the first node fits, that node cut to the
        budget (at its own characters per token; ``budget_truncations``) rather than nothing."""
        budget = self.config.budget_tokens
        kept = budget_prefix([self.forest.nodes[n].n_tokens for n in ordered], budget)
        state.counts["budget_truncations"] = int(kept == 0 and bool(ordered))
        if kept or not ordered:
            return [self.forest.chunk(n) for n in ordered[:kept]]
        whole = self.forest.chunk(ordered[0])
        chars = max(1, len(whole.text) * budget // max(whole.n_tokens, 1))
        return [replace(whole, text=whole.text[:chars], end=whole.start + chars, n_tokens=budget)]
