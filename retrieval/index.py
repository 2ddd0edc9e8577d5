"""Chunk indexes: dense (embeddings, exact inner-product search), BM25 (bm25s) and hybrid (RRF).

Each index holds the chunks it was built over (chosen levels of the hierarchies), answers
``search(queries, k) -> list[list[Hit]]`` and saves to / loads from a folder that also keeps
those chunks, so a saved index is self-contained. Dense indexes embed through an ``embed``
callable, normally ``lambda texts: client.embed("embedder", texts)``: the retrieval runtime
reaches models only through the serving client (DESIGN.md).

Every ``search`` takes ``doc_ids``, a question's document scope (QASPER asks about one paper): only the chunks of
those documents compete, scored as in the whole index (BM25 keeps its corpus-wide statistics), so a scoped ranking
is the corpus ranking with the other documents' chunks left out. The rows of each document are found once, at
construction; a scoped search scores only those rows. ``None`` searches everything.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from overstory.core.records import Chunk, read_jsonl, write_jsonl

EmbedFn = Callable[[list[str]], np.ndarray]
Scope = Collection[str] | None  # the document ids a search is restricted to; None: every document


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float


def chunk_text_for_index(chunk: Chunk) -> str:
    """What gets indexed: the document title gives the chunk its context (as in HotpotQA's setup)."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


def document_rows(chunks: Sequence[Chunk]) -> dict[str, np.ndarray]:
    """Each document's row positions in ``chunks``, ascending: what a scoped search scores.

    >>> a, b, c = (Chunk(i, d, "paragraph", i, None, [], 0, 1, 1) for i, d in (("a", "x"), ("b", "y"), ("c", "x")))
    >>> {d: rows.tolist() for d, rows in document_rows([a, b, c]).items()}
    {'x': [0, 2], 'y': [1]}
    """
    rows: dict[str, list[int]] = {}
    for i, chunk in enumerate(chunks):
        rows.setdefault(chunk.doc_id, []).append(i)
    return {doc_id: np.asarray(found, dtype=np.int64) for doc_id, found in rows.items()}


def scope_rows(rows: dict[str, np.ndarray], doc_ids: Collection[str]) -> np.ndarray:
    """The ascending rows of the documents ``doc_ids`` (a document without chunks here adds none).

    >>> scope_rows({"x": np.array([0, 2]), "y": np.array([1])}, ["y", "x", "z"]).tolist()
    [0, 1, 2]
    """
    found = [rows[d] for d in dict.fromkeys(doc_ids) if d in rows]
    return np.sort(np.concatenate(found)) if found else np.zeros(0, dtype=np.int64)


def top_rows(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the ``k`` best of ``rows`` given their ``scores`` (queries x len(rows)), ties in row order:
    (rows, scores), each queries x k.

    >>> top_rows(np.array([[0.9, 0.5, 0.9]]), np.array([1, 2, 3]), 2)
    (array([[1, 3]]), array([[0.9, 0.9]]))
    """
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return rows[order], np.take_along_axis(scores, order, axis=1)


def _save_chunks(folder: Path, kind: str, chunks: Sequence[Chunk], extra: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_jsonl(folder / "chunks.jsonl", chunks)
    (folder / "index.json").write_text(json.dumps({"kind": kind, "n_chunks": len(chunks), **extra}, indent=2))


def _load_meta(folder: Path, kind: str) -> tuple[dict, list[Chunk]]:
    meta_path = Path(folder) / "index.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{folder} holds no saved index (index.json missing)")
    meta = json.loads(meta_path.read_text())
    if meta.get("kind") != kind:
        raise ValueError(f"{folder} holds a {meta.get('kind')!r} index, not {kind!r}")
    return meta, list(read_jsonl(Path(folder) / "chunks.jsonl", Chunk))


class DenseIndex:
    """Exact maximum-inner-product search over L2-normalised embeddings (cosine similarity).

    ``backend="numpy"`` is a matrix product; ``backend="faiss"`` uses ``faiss.IndexFlatIP``, the
    same exact search with faiss's BLAS kernels, useful once a corpus has millions of chunks.
    """

    kind = "dense"

    def __init__(self, chunks: Sequence[Chunk], embeddings: np.ndarray, embed: EmbedFn,
                 backend: Literal["numpy", "faiss"] = "numpy"):
        if len(chunks) != len(embeddings):
            raise ValueError(f"{len(chunks)} chunks but {len(embeddings)} embeddings")
        self.chunks = list(chunks)
        self.embeddings = _normalise(np.asarray(embeddings, dtype=np.float32))
        self.embed = embed
        self.backend = backend
        self.rows = document_rows(self.chunks)
        self._faiss = None
        if backend == "faiss":
            import faiss

            self._faiss = faiss.IndexFlatIP(self.embeddings.shape[1])
            self._faiss.add(self.embeddings)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], embed: EmbedFn, batch_size: int = 256,
              backend: Literal["numpy", "faiss"] = "numpy") -> DenseIndex:
        texts = [chunk_text_for_index(c) for c in chunks]
        parts = [np.asarray(embed(texts[i:i + batch_size])) for i in range(0, len(texts), batch_size)]
        return cls(chunks, np.concatenate(parts) if parts else np.zeros((0, 1), np.float32), embed, backend)

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query (of the documents ``doc_ids`` only, when given); ``embed`` overrides the index's
        own query encoder for this call (the evaluation harness passes one that goes through the question's own
        client, so its cost is counted). A scoped search is exact over its rows, whatever the backend."""
        if not queries:
            return []
        q = _normalise(np.asarray((embed or self.embed)(list(queries)), dtype=np.float32))
        if doc_ids is not None:
            rows = scope_rows(self.rows, doc_ids)
            idx, scores = top_rows(q @ self.embeddings[rows].T, rows, min(k, len(rows)))
        elif self._faiss is not None:
            scores, idx = self._faiss.search(q, min(k, len(self.chunks)))
        else:
            idx, scores = top_rows(q @ self.embeddings.T, np.arange(len(self.chunks)), min(k, len(self.chunks)))
        return [[Hit(self.chunks[j], float(s)) for j, s in zip(row_i, row_s)] for row_i, row_s in zip(idx, scores)]

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        _save_chunks(folder, self.kind, self.chunks, {"dim": int(self.embeddings.shape[1]), "backend": self.backend})
        np.save(folder / "embeddings.npy", self.embeddings)

    @classmethod
    def load(cls, folder: str | Path, embed: EmbedFn) -> DenseIndex:
        meta, chunks = _load_meta(Path(folder), cls.kind)
        return cls(chunks, np.load(Path(folder) / "embeddings.npy"), embed, meta.get("backend", "numpy"))


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class BM25Index:
    """Lexical BM25 (bm25s, Lucene variant) with English stop words and a Snowball stemmer."""

    kind = "bm25"

    def __init__(self, chunks: Sequence[Chunk], model):
        self.chunks = list(chunks)
        self.model = model
        self.rows = document_rows(self.chunks)

    @staticmethod
    def _tokenize(texts: list[str], return_ids: bool):
        import bm25s
        import Stemmer

        return bm25s.tokenize(texts, stopwords="en", stemmer=Stemmer.Stemmer("english"),
                              return_ids=return_ids, show_progress=False)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], k1: float = 1.5, b: float = 0.75) -> BM25Index:
        import bm25s

        model = bm25s.BM25(k1=k1, b=b)
        model.index(cls._tokenize([chunk_text_for_index(c) for c in chunks], True), show_progress=False)
        return cls(chunks, model)

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query by BM25 (of the documents ``doc_ids`` only, when given); ``embed`` is ignored
        (taken so every index kind searches alike)."""
        if not queries:
            return []
        vocab = self.model.vocab_dict
        # Words the corpus never saw carry no BM25 weight; dropping them keeps bm25s from failing
        # on queries made only of unseen words (those then rank by the empty query, all zeros).
        known = [[t for t in toks if t in vocab] for toks in self._tokenize(list(queries), False)]
        if doc_ids is not None:
            return self._scoped(known, scope_rows(self.rows, doc_ids), k)
        k = min(k, len(self.chunks))
        empty = [not toks for toks in known]
        tokens = [toks or [next(iter(vocab))] for toks in known]
        idx, scores = self.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [Hit(self.chunks[int(j)], 0.0 if blank else float(s)) for j, s in zip(row_i, row_s)]
            for row_i, row_s, blank in zip(idx, scores, empty)
        ]

    def _scoped(self, known: list[list[str]], rows: np.ndarray, k: int) -> list[list[Hit]]:
        """Per query, the top-k of ``rows`` by the corpus-wide BM25 scores (a query of unseen words scores 0)."""
        scores = np.stack([self.model.get_scores(toks) if toks else np.zeros(len(self.chunks), np.float32)
                           for toks in known])
        idx, top = top_rows(scores[:, rows], rows, min(k, len(rows)))
        return [[Hit(self.chunks[int(j)], float(s)) for j, s in zip(row_i, row_s)] for row_i, row_s in zip(idx, top)]

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        _save_chunks(folder, self.kind, self.chunks, {"k1": self.model.k1, "b": self.model.b})
        self.model.save(folder / "bm25", show_progress=False)

    @classmethod
    def load(cls, folder: str | Path) -> BM25Index:
        import bm25s

        _, chunks = _load_meta(Path(folder), cls.kind)
        return cls(chunks, bm25s.BM25.load(Path(folder) / "bm25", show_progress=False))


class HybridIndex:
    """Reciprocal rank fusion of dense and BM25 rankings: score = sum 1 / (rrf_k + rank).

    Both member indexes must be built over the same chunks. Each side contributes its top
    ``depth`` hits, so chunks found by only one side still compete.
    """

    kind = "hybrid"

    def __init__(self, dense: DenseIndex, bm25: BM25Index, rrf_k: int = 60, depth: int = 50):
        if [c.id for c in dense.chunks] != [c.id for c in bm25.chunks]:
            raise ValueError("dense and BM25 indexes cover different chunks")
        self.dense, self.bm25, self.rrf_k, self.depth = dense, bm25, rrf_k, depth
        self.chunks = dense.chunks

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query by RRF of both sides' rankings (of the documents ``doc_ids`` only, when given)."""
        depth = max(self.depth, k)
        fused = []
        for dense_hits, bm25_hits in zip(self.dense.search(queries, depth, embed, doc_ids),
                                         self.bm25.search(queries, depth, doc_ids=doc_ids)):
            fused.append(reciprocal_rank_fusion([dense_hits, bm25_hits], self.rrf_k)[:k])
        return fused

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        _save_chunks(folder, self.kind, self.chunks, {"rrf_k": self.rrf_k, "depth": self.depth})
        self.dense.save(folder / "dense")
        self.bm25.save(folder / "bm25")

    @classmethod
    def load(cls, folder: str | Path, embed: EmbedFn) -> HybridIndex:
        meta, _ = _load_meta(Path(folder), cls.kind)
        return cls(DenseIndex.load(Path(folder) / "dense", embed), BM25Index.load(Path(folder) / "bm25"),
                   meta["rrf_k"], meta["depth"])


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hit]], rrf_k: int = 60) -> list[Hit]:
    """Fuse rankings by RRF (Cormack et al. 2009); ties keep first-seen order.

    >>> a, b, c = (Chunk(i, "d", "paragraph", i, None, [], 0, 1, 1) for i in "abc")
    >>> [h.chunk.id for h in reciprocal_rank_fusion([[Hit(a, 1), Hit(b, .5)], [Hit(b, 9), Hit(c, 1)]])]
    ['b', 'a', 'c']
    """
    scores: dict[str, float] = {}
    chunks: dict[str, Chunk] = {}
    for ranking in rankings:
        for rank, hit in enumerate(ranking, 1):
            scores[hit.chunk.id] = scores.get(hit.chunk.id, 0.0) + 1.0 / (rrf_k + rank)
            chunks.setdefault(hit.chunk.id, hit.chunk)
    order = sorted(scores, key=lambda cid: -scores[cid])
    return [Hit(chunks[cid], scores[cid]) for cid in order]


IndexKind = Literal["dense", "bm25", "hybrid"]


def build_index(kind: IndexKind, chunks: Sequence[Chunk], embed: EmbedFn | None = None,
                backend: Literal["numpy", "faiss"] = "numpy"):
    """Build the named index kind; dense and hybrid need ``embed``."""
    if kind == "bm25":
        return BM25Index.build(chunks)
    if embed is None:
        raise ValueError(f"a {kind} index needs an embed function (client.embed for the embedder role)")
    dense = DenseIndex.build(chunks, embed, backend=backend)
    return dense if kind == "dense" else HybridIndex(dense, BM25Index.build(chunks))


def load_index(folder: str | Path, embed: EmbedFn | None = None):
    """Load any saved index, dispatching on the kind recorded in ``index.json``."""
    meta = Path(folder) / "index.json"
    kind = json.loads(meta.read_text()).get("kind") if meta.exists() else None
    if kind == "bm25":
        return BM25Index.load(folder)
    if kind in ("dense", "hybrid"):
        if embed is None:
            raise ValueError(f"loading a {kind} index needs an embed function for queries")
        return (DenseIndex if kind == "dense" else HybridIndex).load(folder, embed)
    raise FileNotFoundError(f"{folder} holds no saved index (index.json missing or unknown kind {kind!r})")
