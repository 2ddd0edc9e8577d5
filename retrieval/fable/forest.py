"""FABLE's forest: one typed tree per document (root > section > subsection > leaf), every node a span of its
document with a title, a summary and an embedding. ``builder.ForestBuilder`` makes it, ``overstory data
fable-forest`` saves it as JSON, and the strategy (``strategy.FableStrategy``) reads it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from overstory.core.records import Chunk, Document

FORMAT = "fable-forest"
FORMAT_VERSION = 1
KINDS = ("root", "section", "subsection", "leaf")  # top to bottom; a group made under a node of depth d is KINDS[d]
LEVEL_OF_KIND = {"root": "document", "section": "section", "subsection": "subsection", "leaf": "paragraph"}


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
        self.rows: dict[str, list[int]] = {}  # each document's nodes as positions in ids (a scoped search's rows)
        for i, node_id in enumerate(self.ids):
            self.rows.setdefault(self.nodes[node_id].doc_id, []).append(i)
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

    def similarities(self, vector: Sequence[float], doc_ids: Collection[str] | None = None) -> dict[str, float]:
        """Cosine of every node's embedding with ``vector``, in forest order; only the nodes of the documents
        ``doc_ids`` (a question's scope) when given, so every path that starts from these scores stays in them."""
        query = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(query))
        if doc_ids is None:
            rows = np.arange(len(self.ids))
        else:
            rows = np.asarray(sorted(i for d in set(doc_ids) for i in self.rows.get(d, [])), dtype=np.int64)
        scores = self.matrix[rows] @ (query / (norm or 1.0))
        return {self.ids[i]: score for i, score in zip(rows.tolist(), scores.tolist())}
