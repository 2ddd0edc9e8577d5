"""Chunk indexes: dense (embeddings, exact inner-product search), BM25 (bm25s) and hybrid (RRF).

Each index holds the chunks it was built over (chosen levels of the hierarchies), answers
``search(queries, k) -> list[list[Hit]]`` and saves to / loads from a folder that also keeps
those chunks, so a saved index is self-contained. Dense indexes embed through an ``embed``
callable, normally ``lambda texts: client.embed("embedder", texts)``: the retrieval runtime
reaches models only through the serving client (DESIGN.md).

Every ``search`` takes ``doc_ids``, a question's document scope (QASPER asks about one paper): only the chunks of
those documents compete, scored as in the whole index (BM25 keeps its corpus-wide statistics), so a scoped ranking
is the corpus ranking with the other documents' chunks left out. The rows of each document are found once, when the
index (or an update of it) is made; a scoped search scores only those rows. ``None`` searches everything.

Persist and update::

    index = build_index("hybrid", chunks, embed, embedding_model=roles["embedder"].model,
                        extra_settings={"levels": ["paragraph"]})
    index.save("runs/index")                      # a new version, swapped in atomically, with its manifest
    index = load_index("runs/index", embed, embedding_model=roles["embedder"].model, settings={"levels": [...]})
    index.add_documents(new_chunks)               # embeds only these; refused if a document id is there
    index.add_documents(new_chunks, replace=True) # or replaces that document's chunks
    index.remove_documents(["hotpotqa/x"])        # refused naming any id the index lacks
    index.save("runs/index")

``embedding_model`` is the served model name behind the ``embed`` callable (the serving config's embedder role:
``RoleConfig.model``), recorded by the caller since the callable cannot tell; ``extra_settings`` are whatever else the
caller wants checked on load (the hierarchy settings and levels the chunks came from). The manifest
(``index_manifest.py``) records them with the index's own settings (backend; BM25 ``k1``, ``b``; RRF ``rrf_k``,
``depth``), the corpus hash and a format version; ``load_index`` refuses another format, another embedding model
(when both the folder and the caller name one) or another value of a setting the caller passes, naming the setting
and both values. A folder saved before manifests loads with a warning: its chunks and vectors are complete, and
refusing it would force re-embedding the corpus, which is what a saved index is for; re-saving it writes a manifest.

Updates: a dense index embeds only the added chunks and keeps every other row's vector bit for bit; BM25 is rebuilt
from the kept token lists (bm25s has no incremental update, and its IDF and average length are corpus-wide, so every
stored score changes with any document); hybrid does both. ``with_documents`` / ``without_documents`` return the
updated index and leave the old one untouched; ``add_documents`` / ``remove_documents`` update in place by swapping
one attribute, so a search running meanwhile in another thread sees the old or the new index, never a mix.
Added chunks go after the kept ones, so ``build(A) + add(B)`` ranks as ``build(A + B)``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from overstory.core.records import Chunk, read_jsonl, write_jsonl
from overstory.retrieval.index_manifest import (
    IndexMismatchError,
    chunk_text_for_index,
    current_version,
    load_saved,
    save_index,
)

EmbedFn = Callable[[list[str]], np.ndarray]
Scope = Collection[str] | None  # the document ids a search is restricted to; None: every document


class DocumentExistsError(ValueError):
    """An add of a document (or chunk id) the index already holds, without ``replace=True``."""


class UnknownDocumentError(LookupError):
    """A removal of a document the index does not hold."""


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float


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


def check_additions(chunks: Sequence[Chunk], existing: Sequence[Chunk], replace: bool) -> set[str]:
    """The documents an add of ``chunks`` replaces (none unless ``replace``); refuses a document already indexed
    (without ``replace``), a chunk id given twice, or one another kept document holds.

    >>> old = [Chunk("x#0", "x", "paragraph", "t", None, [], 0, 1, 1)]
    >>> check_additions([Chunk("x#1", "x", "paragraph", "u", None, [], 0, 1, 1)], old, replace=True)
    {'x'}
    """
    present = {c.doc_id for c in existing}
    again = [d for d in dict.fromkeys(c.doc_id for c in chunks) if d in present]
    if again and not replace:
        raise DocumentExistsError(f"already in the index: document {', '.join(map(repr, again))}; remove it first "
                                  "or add with replace=True")
    twice = sorted(i for i, n in Counter(c.id for c in chunks).items() if n > 1)
    if twice:
        raise ValueError(f"chunk ids given twice in one add: {', '.join(map(repr, twice))}")
    dropped = set(again)
    taken = sorted({c.id for c in existing if c.doc_id not in dropped} & {c.id for c in chunks})
    if taken:
        raise DocumentExistsError("chunk ids already in the index under another document: "
                                  f"{', '.join(map(repr, taken))}")
    return dropped


def check_removals(doc_ids: Iterable[str], existing: Sequence[Chunk]) -> set[str]:
    """The documents to remove; refuses an id the index lacks (naming it) or removing every document."""
    if isinstance(doc_ids, str):
        raise TypeError(f"doc_ids must be a list of document ids, not the string {doc_ids!r}")
    wanted = list(dict.fromkeys(doc_ids))
    present = {c.doc_id for c in existing}
    unknown = [d for d in wanted if d not in present]
    if unknown:
        raise UnknownDocumentError(f"not in the index: document {', '.join(map(repr, unknown))}")
    if present <= set(wanted):
        raise ValueError("removing every document would leave the index empty; build a new index instead")
    return set(wanted)


def _kept_rows(chunks: Sequence[Chunk], dropped: set[str]) -> np.ndarray:
    """Boolean mask of the rows whose document stays."""
    return np.fromiter((c.doc_id not in dropped for c in chunks), dtype=bool, count=len(chunks))


def _merge_settings(own: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """The index's own settings and the caller's recorded ones; the caller may not shadow an own setting."""
    clash = sorted(set(own) & set(extra))
    if clash:
        raise ValueError(f"extra_settings may not redefine the index's own settings: {', '.join(clash)}")
    return {**own, **extra}


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


@dataclass(frozen=True)
class _DenseState:
    """Everything a dense search reads, swapped as one value by an update."""

    chunks: list[Chunk]
    embeddings: np.ndarray
    rows: dict[str, np.ndarray]
    faiss: Any


def _dense_state(chunks: Sequence[Chunk], embeddings: np.ndarray, backend: str) -> _DenseState:
    faiss_index = None
    if backend == "faiss":
        import faiss

        # IndexFlatIP is a copy of the matrix: rebuilt after an update (remove_ids would renumber the rows).
        faiss_index = faiss.IndexFlatIP(embeddings.shape[1])
        faiss_index.add(embeddings)
    return _DenseState(list(chunks), embeddings, document_rows(chunks), faiss_index)


def _embed_chunks(chunks: Sequence[Chunk], embed: EmbedFn, batch_size: int) -> np.ndarray:
    """The L2-normalised embeddings of the chunks' indexed texts, ``batch_size`` texts per call."""
    texts = [chunk_text_for_index(c) for c in chunks]
    parts = [np.asarray(embed(texts[i:i + batch_size])) for i in range(0, len(texts), batch_size)]
    return _normalise(np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, 1), np.float32))

class _InPlaceUpdates:
    """What the three flat indexes share: updates in place and a versioned save. Each class names the one attribute
    that holds its whole state (``_swapped``), so an update is a single assignment: a search running meanwhile sees
    the old or the new index, never a mix."""

    _swapped = "_state"

    def add_documents(self, chunks: Sequence[Chunk], embed: EmbedFn | None = None, *, replace: bool = False) -> None:
        """``with_documents`` in place: one swap of the index's state."""
        setattr(self, self._swapped, getattr(self.with_documents(chunks, embed, replace=replace), self._swapped))

    def remove_documents(self, doc_ids: Iterable[str]) -> None:
        """``without_documents`` in place: one swap of the index's state."""
        setattr(self, self._swapped, getattr(self.without_documents(doc_ids), self._swapped))

    def save(self, folder: str | Path) -> Path:
        """Save as a new version of ``folder``, with its manifest (``index_manifest.save_versioned``)."""
        return save_index(self, folder)



class DenseIndex(_InPlaceUpdates):
    """Exact maximum-inner-product search over L2-normalised embeddings (cosine similarity).

    ``backend="numpy"`` is a matrix product; ``backend="faiss"`` uses ``faiss.IndexFlatIP``, the
    same exact search with faiss's BLAS kernels, useful once a corpus has millions of chunks.
    ``normalised=True`` takes the vectors as unit length already (a saved index, an update) and keeps them bit for bit.
    """

    kind = "dense"

    def __init__(self, chunks: Sequence[Chunk], embeddings: np.ndarray, embed: EmbedFn,
                 backend: Literal["numpy", "faiss"] = "numpy", *, normalised: bool = False,
                 embedding_model: str | None = None, extra_settings: Mapping[str, Any] | None = None):
        if len(chunks) != len(embeddings):
            raise ValueError(f"{len(chunks)} chunks but {len(embeddings)} embeddings")
        vectors = np.asarray(embeddings, dtype=np.float32)
        self._state = _dense_state(chunks, vectors if normalised else _normalise(vectors), backend)
        self.embed, self.backend, self.embedding_model = embed, backend, embedding_model
        self.extra_settings = dict(extra_settings or {})

    chunks = property(lambda self: self._state.chunks, doc="The indexed chunks, in row order.")
    embeddings = property(lambda self: self._state.embeddings, doc="Their unit-length vectors, one row each.")
    rows = property(lambda self: self._state.rows, doc="Each document's rows (``document_rows``).")

    @property
    def settings(self) -> dict[str, Any]:
        """What the manifest records and ``load_index(settings=...)`` checks."""
        return _merge_settings({"backend": self.backend}, self.extra_settings)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], embed: EmbedFn, batch_size: int = 256,
              backend: Literal["numpy", "faiss"] = "numpy", *, embedding_model: str | None = None,
              extra_settings: Mapping[str, Any] | None = None) -> DenseIndex:
        return cls(chunks, _embed_chunks(chunks, embed, batch_size), embed, backend, normalised=True,
                   embedding_model=embedding_model, extra_settings=extra_settings)

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query (of the documents ``doc_ids`` only, when given); ``embed`` overrides the index's
        own query encoder for this call (the evaluation harness passes one that goes through the question's own
        client, so its cost is counted). A scoped search is exact over its rows, whatever the backend."""
        if not queries:
            return []
        state = self._state  # one snapshot: an update meanwhile swaps in a new state, never changes this one
        q = _normalise(np.asarray((embed or self.embed)(list(queries)), dtype=np.float32))
        if doc_ids is not None:
            rows = scope_rows(state.rows, doc_ids)
            idx, scores = top_rows(q @ state.embeddings[rows].T, rows, min(k, len(rows)))
        elif state.faiss is not None:
            scores, idx = state.faiss.search(q, min(k, len(state.chunks)))
        else:
            idx, scores = top_rows(q @ state.embeddings.T, np.arange(len(state.chunks)), min(k, len(state.chunks)))
        return [[Hit(state.chunks[j], float(s)) for j, s in zip(row_i, row_s)] for row_i, row_s in zip(idx, scores)]

    def _derive(self, chunks: list[Chunk], vectors: np.ndarray) -> DenseIndex:
        """A new index over these rows (unit vectors, kept bit for bit) with this one's encoder and records."""
        return DenseIndex(chunks, vectors, self.embed, self.backend, normalised=True,
                          embedding_model=self.embedding_model, extra_settings=self.extra_settings)

    def with_documents(self, chunks: Sequence[Chunk], embed: EmbedFn | None = None, *, replace: bool = False,
                       batch_size: int = 256) -> DenseIndex:
        """This index plus ``chunks`` (embedded here, by ``embed`` or the index's own encoder), after the kept rows;
        with ``replace``, the chunks of their documents already here are dropped first."""
        state = self._state
        keep = _kept_rows(state.chunks, check_additions(chunks, state.chunks, replace))
        dim = state.embeddings.shape[1]
        added = _embed_chunks(chunks, embed or self.embed, batch_size) if chunks else np.zeros((0, dim), np.float32)
        if added.shape[1] != dim:
            raise ValueError(f"the added chunks embed to {added.shape[1]} dimensions but the index has {dim}: "
                             "another embedding model than the index was built with")
        kept = [c for c, k in zip(state.chunks, keep) if k]
        return self._derive([*kept, *chunks], np.concatenate([state.embeddings[keep], added]))

    def without_documents(self, doc_ids: Iterable[str]) -> DenseIndex:
        """This index without the chunks of ``doc_ids`` (every one must be here); the other rows are kept bit for
        bit."""
        state = self._state
        keep = _kept_rows(state.chunks, check_removals(doc_ids, state.chunks))
        return self._derive([c for c, k in zip(state.chunks, keep) if k], state.embeddings[keep])

    def _write(self, folder: Path) -> None:
        state = self._state
        _save_chunks(folder, self.kind, state.chunks, {"dim": int(state.embeddings.shape[1]), "backend": self.backend})
        np.save(folder / "embeddings.npy", state.embeddings)

    @classmethod
    def load(cls, folder: str | Path, embed: EmbedFn, *, embedding_model: str | None = None,
             settings: Mapping[str, Any] | None = None) -> DenseIndex:
        """The index saved in ``folder``, checked against its manifest (``load_index``)."""
        return load_saved(cls, folder, embed, embedding_model, settings)

    @classmethod
    def _read(cls, folder: Path, embed: EmbedFn | None, embedding_model: str | None) -> DenseIndex:
        meta, chunks = _load_meta(folder, cls.kind)
        return cls(chunks, np.load(folder / "embeddings.npy"), embed, meta.get("backend", "numpy"), normalised=True,
                   embedding_model=embedding_model)


def _normalise(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


@dataclass(frozen=True)
class _BM25State:
    """Everything a BM25 search reads (and an update rebuilds from), swapped as one value."""

    chunks: list[Chunk]
    model: Any  # bm25s.BM25
    rows: dict[str, np.ndarray]
    tokens: list[list[str]] | None  # each chunk's tokens; None until an update needs them (a loaded index)


def _tokenize(texts: list[str], return_ids: bool):
    import bm25s
    import Stemmer

    return bm25s.tokenize(texts, stopwords="en", stemmer=Stemmer.Stemmer("english"), return_ids=return_ids,
                          show_progress=False)


def _bm25_state(chunks: Sequence[Chunk], tokens: list[list[str]], k1: float, b: float) -> _BM25State:
    """A BM25 model indexed over ``tokens`` (one list per chunk)."""
    import bm25s

    model = bm25s.BM25(k1=k1, b=b)
    model.index(tokens, show_progress=False)
    return _BM25State(list(chunks), model, document_rows(chunks), tokens)


class BM25Index(_InPlaceUpdates):
    """Lexical BM25 (bm25s, Lucene variant) with English stop words and a Snowball stemmer."""

    kind = "bm25"
    embedding_model: str | None = None  # lexical: no embedding model

    def __init__(self, chunks: Sequence[Chunk], model, *, tokens: list[list[str]] | None = None,
                 extra_settings: Mapping[str, Any] | None = None):
        self._state = _BM25State(list(chunks), model, document_rows(chunks), tokens)
        self.extra_settings = dict(extra_settings or {})

    chunks = property(lambda self: self._state.chunks, doc="The indexed chunks, in row order.")
    model = property(lambda self: self._state.model, doc="The bm25s model over them.")
    rows = property(lambda self: self._state.rows, doc="Each document's rows (``document_rows``).")

    @property
    def settings(self) -> dict[str, Any]:
        """What the manifest records and ``load_index(settings=...)`` checks."""
        return _merge_settings({"k1": self.model.k1, "b": self.model.b}, self.extra_settings)

    @classmethod
    def build(cls, chunks: Sequence[Chunk], k1: float = 1.5, b: float = 0.75, *,
              extra_settings: Mapping[str, Any] | None = None) -> BM25Index:
        state = _bm25_state(chunks, _tokenize([chunk_text_for_index(c) for c in chunks], False), k1, b)
        return cls(state.chunks, state.model, tokens=state.tokens, extra_settings=extra_settings)

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query by BM25 (of the documents ``doc_ids`` only, when given); ``embed`` is ignored
        (taken so every index kind searches alike)."""
        if not queries:
            return []
        state = self._state  # one snapshot: an update meanwhile swaps in a new state, never changes this one
        vocab = state.model.vocab_dict
        # Words the corpus never saw carry no BM25 weight; dropping them keeps bm25s from failing
        # on queries made only of unseen words (those then rank by the empty query, all zeros).
        known = [[t for t in toks if t in vocab] for toks in _tokenize(list(queries), False)]
        if doc_ids is not None:
            return self._scoped(state, known, scope_rows(state.rows, doc_ids), k)
        k = min(k, len(state.chunks))
        empty = [not toks for toks in known]
        tokens = [toks or [next(iter(vocab))] for toks in known]
        idx, scores = state.model.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [Hit(state.chunks[int(j)], 0.0 if blank else float(s)) for j, s in zip(row_i, row_s)]
            for row_i, row_s, blank in zip(idx, scores, empty)
        ]

    @staticmethod
    def _scoped(state: _BM25State, known: list[list[str]], rows: np.ndarray, k: int) -> list[list[Hit]]:
        """Per query, the top-k of ``rows`` by the corpus-wide BM25 scores (a query of unseen words scores 0)."""
        scores = np.stack([state.model.get_scores(toks) if toks else np.zeros(len(state.chunks), np.float32)
                           for toks in known])
        idx, top = top_rows(scores[:, rows], rows, min(k, len(rows)))
        return [[Hit(state.chunks[int(j)], float(s)) for j, s in zip(row_i, row_s)] for row_i, row_s in zip(idx, top)]

    def _rebuilt(self, state: _BM25State, keep: np.ndarray, added: Sequence[Chunk]) -> BM25Index:
        """A new index over the kept rows and ``added``: bm25s (0.3) has no incremental update (its IDF and average
        length are corpus-wide, so every stored score changes), so the model is rebuilt from the kept token lists
        and the added chunks' tokens; only the added chunks are tokenised (all of them once after a load)."""
        tokens = state.tokens if state.tokens is not None else \
            _tokenize([chunk_text_for_index(c) for c in state.chunks], False)
        new_tokens = _tokenize([chunk_text_for_index(c) for c in added], False) if added else []
        chunks = [*(c for c, k in zip(state.chunks, keep) if k), *added]
        kept_tokens = [t for t, k in zip(tokens, keep) if k]
        rebuilt = _bm25_state(chunks, [*kept_tokens, *new_tokens], state.model.k1, state.model.b)
        return BM25Index(rebuilt.chunks, rebuilt.model, tokens=rebuilt.tokens, extra_settings=self.extra_settings)

    def with_documents(self, chunks: Sequence[Chunk], embed: EmbedFn | None = None, *,
                       replace: bool = False) -> BM25Index:
        """This index plus ``chunks``, after the kept rows (``embed`` is ignored, taken so every kind updates alike);
        with ``replace``, the chunks of their documents already here are dropped first."""
        state = self._state
        return self._rebuilt(state, _kept_rows(state.chunks, check_additions(chunks, state.chunks, replace)), chunks)

    def without_documents(self, doc_ids: Iterable[str]) -> BM25Index:
        """This index without the chunks of ``doc_ids`` (every one must be here): no term of theirs is left."""
        state = self._state
        return self._rebuilt(state, _kept_rows(state.chunks, check_removals(doc_ids, state.chunks)), [])

    def _write(self, folder: Path) -> None:
        state = self._state
        _save_chunks(folder, self.kind, state.chunks, {"k1": state.model.k1, "b": state.model.b})
        state.model.save(folder / "bm25", show_progress=False)

    @classmethod
    def load(cls, folder: str | Path, embed: EmbedFn | None = None, *, embedding_model: str | None = None,
             settings: Mapping[str, Any] | None = None) -> BM25Index:
        """The index saved in ``folder``, checked against its manifest (``load_index``)."""
        return load_saved(cls, folder, embed, embedding_model, settings)

    @classmethod
    def _read(cls, folder: Path, embed: EmbedFn | None, embedding_model: str | None) -> BM25Index:
        import bm25s

        _, chunks = _load_meta(folder, cls.kind)
        model = bm25s.BM25.load(folder / "bm25", show_progress=False)
        if model.scores["num_docs"] != len(chunks):
            raise IndexMismatchError(f"{folder}: the BM25 model covers {model.scores['num_docs']} chunks but "
                                     f"chunks.jsonl holds {len(chunks)}")
        return cls(chunks, model)


class HybridIndex(_InPlaceUpdates):
    """Reciprocal rank fusion of dense and BM25 rankings: score = sum 1 / (rrf_k + rank).

    Both member indexes must be built over the same chunks. Each side contributes its top
    ``depth`` hits, so chunks found by only one side still compete. An update makes new member indexes
    (``dense`` and ``bm25`` then name them) and swaps the pair at once.
    """

    _swapped = "_members"

    kind = "hybrid"

    def __init__(self, dense: DenseIndex, bm25: BM25Index, rrf_k: int = 60, depth: int = 50, *,
                 extra_settings: Mapping[str, Any] | None = None):
        if [c.id for c in dense.chunks] != [c.id for c in bm25.chunks]:
            raise ValueError("dense and BM25 indexes cover different chunks")
        self._members = (dense, bm25)
        self.rrf_k, self.depth = rrf_k, depth
        self.extra_settings = dict(extra_settings or {})

    dense = property(lambda self: self._members[0], doc="The dense side.")
    bm25 = property(lambda self: self._members[1], doc="The BM25 side.")
    chunks = property(lambda self: self._members[0].chunks, doc="The indexed chunks, in row order.")
    embedding_model = property(lambda self: self._members[0].embedding_model, doc="The dense side's.")

    @property
    def settings(self) -> dict[str, Any]:
        """What the manifest records and ``load_index(settings=...)`` checks."""
        dense, bm25 = self._members
        own = {"rrf_k": self.rrf_k, "depth": self.depth, "backend": dense.backend, "k1": bm25.model.k1,
               "b": bm25.model.b}
        return _merge_settings(own, self.extra_settings)

    def search(self, queries: Sequence[str], k: int = 10, embed: EmbedFn | None = None,
               doc_ids: Scope = None) -> list[list[Hit]]:
        """Top-k chunks per query by RRF of both sides' rankings (of the documents ``doc_ids`` only, when given)."""
        dense, bm25 = self._members  # one snapshot of the pair
        depth = max(self.depth, k)
        fused = []
        for dense_hits, bm25_hits in zip(dense.search(queries, depth, embed, doc_ids),
                                         bm25.search(queries, depth, doc_ids=doc_ids)):
            fused.append(reciprocal_rank_fusion([dense_hits, bm25_hits], self.rrf_k)[:k])
        return fused

    def _derive(self, dense: DenseIndex, bm25: BM25Index) -> HybridIndex:
        return HybridIndex(dense, bm25, self.rrf_k, self.depth, extra_settings=self.extra_settings)

    def with_documents(self, chunks: Sequence[Chunk], embed: EmbedFn | None = None, *,
                       replace: bool = False) -> HybridIndex:
        """This index plus ``chunks`` on both sides (embedded once, by ``embed`` or the dense side's encoder)."""
        dense, bm25 = self._members
        return self._derive(dense.with_documents(chunks, embed, replace=replace),
                            bm25.with_documents(chunks, replace=replace))

    def without_documents(self, doc_ids: Iterable[str]) -> HybridIndex:
        """This index without the chunks of ``doc_ids`` on both sides (every one must be here)."""
        doc_ids = list(doc_ids) if not isinstance(doc_ids, str) else doc_ids
        dense, bm25 = self._members
        return self._derive(dense.without_documents(doc_ids), bm25.without_documents(doc_ids))

    def _write(self, folder: Path) -> None:
        dense, bm25 = self._members
        _save_chunks(folder, self.kind, dense.chunks, {"rrf_k": self.rrf_k, "depth": self.depth})
        dense._write(folder / "dense")
        bm25._write(folder / "bm25")

    @classmethod
    def load(cls, folder: str | Path, embed: EmbedFn, *, embedding_model: str | None = None,
             settings: Mapping[str, Any] | None = None) -> HybridIndex:
        """The index saved in ``folder``, checked against its manifest (``load_index``)."""
        return load_saved(cls, folder, embed, embedding_model, settings)

    @classmethod
    def _read(cls, folder: Path, embed: EmbedFn | None, embedding_model: str | None) -> HybridIndex:
        meta, _ = _load_meta(folder, cls.kind)
        return cls(DenseIndex._read(folder / "dense", embed, embedding_model),
                   BM25Index._read(folder / "bm25", None, None), meta["rrf_k"], meta["depth"])


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


FlatIndex = DenseIndex | BM25Index | HybridIndex
IndexKind = Literal["dense", "bm25", "hybrid"]
INDEX_CLASSES: dict[str, type[DenseIndex] | type[BM25Index] | type[HybridIndex]] = {
    "dense": DenseIndex, "bm25": BM25Index, "hybrid": HybridIndex}


def build_index(kind: IndexKind, chunks: Sequence[Chunk], embed: EmbedFn | None = None,
                backend: Literal["numpy", "faiss"] = "numpy", *, embedding_model: str | None = None,
                extra_settings: Mapping[str, Any] | None = None) -> FlatIndex:
    """Build the named index kind; dense and hybrid need ``embed``. ``embedding_model`` (the served model behind
    ``embed``) and ``extra_settings`` are recorded in the manifest when it is saved."""
    if kind == "bm25":
        return BM25Index.build(chunks, extra_settings=extra_settings)
    if embed is None:
        raise ValueError(f"a {kind} index needs an embed function (client.embed for the embedder role)")
    if kind == "dense":
        return DenseIndex.build(chunks, embed, backend=backend, embedding_model=embedding_model,
                                extra_settings=extra_settings)
    dense = DenseIndex.build(chunks, embed, backend=backend, embedding_model=embedding_model)
    return HybridIndex(dense, BM25Index.build(chunks), extra_settings=extra_settings)


def load_index(folder: str | Path, embed: EmbedFn | None = None, *, embedding_model: str | None = None,
               settings: Mapping[str, Any] | None = None) -> FlatIndex:
    """Load any saved index, dispatching on its kind, and check its manifest: refused (``IndexMismatchError``,
    naming the setting and both values) when written in another format, with another embedding model than
    ``embedding_model`` (when the folder and the caller both name one) or with another value of a key of
    ``settings``; a folder saved before manifests loads with a warning."""
    files = current_version(folder) or Path(folder)
    meta = files / "index.json"
    kind = json.loads(meta.read_text()).get("kind") if meta.exists() else None
    if kind not in INDEX_CLASSES:
        raise FileNotFoundError(f"{folder} holds no saved index (index.json missing or unknown kind {kind!r})")
    if kind != "bm25" and embed is None:
        raise ValueError(f"loading a {kind} index needs an embed function for queries")
    return INDEX_CLASSES[kind].load(folder, embed, embedding_model=embedding_model, settings=settings)
