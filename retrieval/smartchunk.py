"""SmartChunk retrieval: search only the chunks whose level lies in the planner's range.

Embeddings of every chunk are computed once, bottom-up: the levels in ``direct_levels`` (sentences
by default) are embedded directly by the ``embedder`` role; every level above is embedded by the
``compressor`` role from its children's embeddings, e_comp = S(emb(c_1), ..., emb(c_m)), so no LLM
summary is needed at indexing time. ``upper="direct"`` embeds every level directly instead (the
``direct_encode`` baseline). A query for a level range then searches the matching subset.

``answer`` adds the generator on top; it is what the planner's QA reward calls for a predicted range.
``SmartChunkStrategy`` is the whole runtime as a strategy of the evaluation harness: the served planner picks the
range for each question, then the range's chunks are searched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import (
    LEVEL_RANK,
    Chunk,
    Document,
    check_level,
    level_range,
    read_jsonl,
    write_jsonl,
)
from overstory.models.planner import document_metadata, parse_plan, planner_messages
from overstory.models.registry import SMOLLM2, load_tokenizer
from overstory.retrieval.answer import AnswerConfig, answer_messages, generate_answer
from overstory.retrieval.index import DenseIndex, Hit, check_additions, check_removals, chunk_text_for_index
from overstory.retrieval.index_manifest import (
    IndexMismatchError,
    check_contents,
    check_manifest,
    chunks_hash,
    read_manifest,
    write_manifest,
)
from overstory.retrieval.strategy import Retrieval, StrategyAnswer, raise_if_refused
from overstory.serving.client import ChatResult, Client, ClientError

# The range searched when a planner's reply has no usable plan: one setting for the runtime (``SmartChunkConfig``)
# and for ``eval planner``, which answers through the same runtime. sentence..paragraph is the most common label of
# the planner mix and the fixed range that scores best on its training questions, at about half the tokens that
# sentence..document reads (whose top k can be whole documents).
FALLBACK_RANGE: tuple[str, str] = ("sentence", "paragraph")
SMARTCHUNK_KIND = "smartchunk"  # the kind a saved SmartChunk index's manifest names
# each chunk retrieved for a (question, range) answer is cut at this many characters in the prompt (AnswerConfig's
# default): what pseudo-labelling, the planner's QA reward and eval planner's answers read
READ_CHARS = AnswerConfig.max_chunk_chars


def check_fallback_range(value: Sequence[str], key: str) -> tuple[str, str]:
    """``value`` as a (level_min, level_max) pair of known levels, smallest first; a ConfigError naming ``key``.

    >>> check_fallback_range(["sentence", "section"], "fallback_range")
    ('sentence', 'section')
    """
    try:
        low, high = value
        level_range(low, high)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}; give [level_min, level_max], e.g. [sentence, paragraph]") from exc
    return low, high


class SmartChunkRetriever:
    """Every chunk's embedding (bottom-up, see the module docstring) and a dense index per level range.

    ``embeddings`` (chunk id -> vector) skips the embedding: a loaded index, an update. ``with_documents`` and
    ``without_documents`` return a new retriever, embedding only the added documents' chunks (a chunk's children are
    in its own document, so no other vector changes) and keeping every other vector bit for bit. A save records the
    served embedder's model and, with ``upper="compressor"``, the served compressor's (``compressor_model``); a load
    refuses another of either, since the vectors of an added document would not match the saved ones.
    """

    def __init__(self, chunks: Sequence[Chunk], client: Client, upper: Literal["compressor", "direct"] = "compressor",
                 direct_levels: Sequence[str] = ("sentence",), batch_size: int = 256,
                 embeddings: dict[str, np.ndarray] | None = None, *, embedding_model: str | None = None,
                 settings: Mapping[str, Any] | None = None, compressor_model: str | None = None):
        self.client, self.upper, self.batch_size = client, upper, batch_size
        # what a save records: the served embedder's model, the hierarchy's settings and the served compressor's model
        # (None when no compressor made the vectors: upper="direct")
        self.embedding_model, self.settings = embedding_model, dict(settings or {})
        self.compressor_model = compressor_model if upper == "compressor" else None
        self.direct_levels = tuple(check_level(level) for level in direct_levels)
        self.chunks = list(chunks)
        self.embeddings = embeddings if embeddings is not None else self._embed_bottom_up(self.chunks, client)
        self._indexes: dict[tuple[str, str], DenseIndex] = {}

    def _embed_bottom_up(self, chunks: Sequence[Chunk], client: Client) -> dict[str, np.ndarray]:
        """The vectors of ``chunks`` (whole documents: every child of a chunk is among them), through ``client``."""
        direct = set(self.direct_levels) if self.upper == "compressor" else set(LEVEL_RANK)
        vectors: dict[str, np.ndarray] = {}
        for level in sorted(LEVEL_RANK, key=LEVEL_RANK.get):  # children before parents
            at_level = [c for c in chunks if c.level == level]
            for start in range(0, len(at_level), self.batch_size):
                batch = at_level[start:start + self.batch_size]
                if level in direct or not batch[0].children:
                    rows = client.embed("embedder", [chunk_text_for_index(c) for c in batch])
                else:
                    rows = client.compress("compressor", embeddings=[
                        np.stack([vectors[child] for child in c.children]) for c in batch])
                vectors.update(zip((c.id for c in batch), rows))
        return vectors

    def _derive(self, chunks: list[Chunk], embeddings: dict[str, np.ndarray]) -> SmartChunkRetriever:
        return SmartChunkRetriever(chunks, self.client, self.upper, self.direct_levels, self.batch_size, embeddings,
                                   embedding_model=self.embedding_model, settings=self.settings,
                                   compressor_model=self.compressor_model)

    def with_documents(self, chunks: Sequence[Chunk], client: Client, replace: bool = False) -> SmartChunkRetriever:
        """A retriever over these chunks plus ``chunks`` (their documents' whole hierarchy, embedded through
        ``client``), after the kept ones; with ``replace`` the old chunks of those documents go first."""
        dropped = check_additions(chunks, self.chunks, replace)
        kept = [c for c in self.chunks if c.doc_id not in dropped]
        added = self._embed_bottom_up(chunks, client)
        return self._derive([*kept, *chunks], {**{c.id: self.embeddings[c.id] for c in kept}, **added})

    def without_documents(self, doc_ids: Iterable[str]) -> SmartChunkRetriever:
        """A retriever without the chunks (and vectors) of ``doc_ids``, every one of which must be here."""
        dropped = check_removals(doc_ids, self.chunks)
        kept = [c for c in self.chunks if c.doc_id not in dropped]
        return self._derive(kept, {c.id: self.embeddings[c.id] for c in kept})

    def save(self, folder: Path) -> None:
        """The chunks, their vectors (one row each, in chunk order) and a manifest in ``folder``."""
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "chunks.jsonl", self.chunks)
        np.save(folder / "embeddings.npy", np.stack([self.embeddings[c.id] for c in self.chunks]))
        write_manifest(folder, {"kind": SMARTCHUNK_KIND, "corpus_hash": chunks_hash(self.chunks),
                                "n_chunks": len(self.chunks), "n_documents": len({c.doc_id for c in self.chunks}),
                                "embedding_model": self.embedding_model, "compressor_model": self.compressor_model,
                                "settings": {
                                    "upper": self.upper, "direct_levels": list(self.direct_levels),
                                    "hierarchy": self.settings}})

    @classmethod
    def load(cls, folder: Path, client: Client, upper: Literal["compressor", "direct"], embedding_model: str | None,
             settings: Mapping[str, Any] | None, compressor_model: str | None = None) -> SmartChunkRetriever:
        """The retriever ``save`` wrote, refused (``IndexMismatchError``) when made another way (``upper``, the
        embedding model, the compressor's model, the hierarchy ``settings`` when given) or when its files disagree
        with its manifest."""
        manifest = read_manifest(folder)
        wanted = {"upper": upper, **({"hierarchy": dict(settings)} if settings is not None else {})}
        check_manifest(manifest, folder, embedding_model, wanted)
        check_compressor(manifest, folder, compressor_model)
        chunks = list(read_jsonl(folder / "chunks.jsonl", Chunk))
        vectors = np.load(folder / "embeddings.npy")
        check_contents(manifest, folder, SMARTCHUNK_KIND, len(chunks), chunks_hash(chunks))
        if len(vectors) != len(chunks):
            raise IndexMismatchError(f"{folder}: {len(vectors)} vectors for {len(chunks)} chunks")
        return cls(chunks, client, upper, manifest["settings"]["direct_levels"],
                   embeddings=dict(zip((c.id for c in chunks), vectors)),
                   embedding_model=manifest.get("embedding_model"), settings=manifest["settings"]["hierarchy"],
                   compressor_model=manifest.get("compressor_model"))

    def index(self, level_min: str, level_max: str) -> DenseIndex:
        """The dense index over the chunks of levels level_min..level_max (built once per range)."""
        key = (level_min, level_max)
        if key not in self._indexes:
            levels = set(level_range(level_min, level_max))
            subset = [c for c in self.chunks if c.level in levels]
            self._indexes[key] = DenseIndex(subset, np.stack([self.embeddings[c.id] for c in subset]),
                                            lambda texts: self.client.embed("embedder", texts))
        return self._indexes[key]

    def retrieve(self, questions: Sequence[str], level_min: str, level_max: str, k: int = 5) -> list[list[Hit]]:
        return self.index(level_min, level_max).search(questions, k)

    def answer(self, question: str, level_min: str, level_max: str, k: int = 5,
               max_tokens: int = 24) -> tuple[ChatResult, list[Chunk]]:
        """Retrieve the top-k chunks of the range and let the generator answer from them (each cut at
        ``READ_CHARS`` characters)."""
        chunks = [hit.chunk for hit in self.retrieve([question], level_min, level_max, k)[0]]
        reply = self.client.chat("generator", answer_messages(question, chunks, max_chunk_chars=READ_CHARS),
                                 max_tokens=max_tokens, temperature=0)
        return reply, chunks


def check_compressor(manifest: Mapping[str, Any], folder: str | Path, compressor_model: str | None) -> None:
    """Refuse a saved SmartChunk index whose upper levels another compressor made than ``compressor_model`` (the one
    served now), when both are known; the error names both.

    >>> check_compressor({"compressor_model": "a"}, "f", "a")
    >>> check_compressor({"compressor_model": "a"}, "f", "b")
    Traceback (most recent call last):
    ...
    overstory.retrieval.index_manifest.IndexMismatchError: f: compressor_model is 'a' in the saved index but the ...
    """
    recorded = manifest.get("compressor_model")
    if compressor_model is not None and recorded is not None and recorded != compressor_model:
        raise IndexMismatchError(f"{folder}: compressor_model is {recorded!r} in the saved index but the served "
                                 f"compressor is {compressor_model!r}; rebuild the index with {compressor_model!r} or "
                                 f"serve {recorded!r} as the compressor")


class DocumentRetrievers:
    """One ``SmartChunkRetriever`` per document, built on first use and shared between threads.

    SmartChunk plans per document (the planner reads the document's beginning), so pseudo-labelling,
    the QA reward and ``eval planner`` retrieve among one document's chunks only.
    """

    def __init__(self, chunks: Sequence[Chunk], client: Client, upper: Literal["compressor", "direct"] = "direct"):
        self.client, self.upper = client, upper
        self._chunks: dict[str, list[Chunk]] = {}
        for chunk in chunks:
            self._chunks.setdefault(chunk.doc_id, []).append(chunk)
        self._retrievers: dict[str, SmartChunkRetriever] = {}
        self._locks: dict[str, threading.Lock] = {doc_id: threading.Lock() for doc_id in self._chunks}

    def __getitem__(self, doc_id: str) -> SmartChunkRetriever:
        if doc_id not in self._chunks:
            raise KeyError(f"document {doc_id!r} is not in the hierarchy")
        with self._locks[doc_id]:
            if doc_id not in self._retrievers:
                self._retrievers[doc_id] = SmartChunkRetriever(self._chunks[doc_id], self.client, upper=self.upper)
        return self._retrievers[doc_id]


@dataclass(frozen=True)
class SmartChunkConfig:
    # how levels above sentences are embedded: "compressor" needs a served compressor role (a `train compressor`
    # checkpoint); "direct" embeds every level with the embedder (the direct_encode baseline)
    upper: Literal["compressor", "direct"] = "direct"
    k: int = 5
    planner_max_tokens: int = 160  # the planner's reasoning is trained to stay under 128 tokens
    metadata_tokens: int = 256  # the document beginning the planner reads (as stitch.yaml trains it)
    tokenizer: str = SMOLLM2  # counts the metadata tokens; the planner's own tokenizer
    # the range searched when the planner's reply has no usable plan (counted as the repair plan_unparsed, the range
    # read in the details' plan; not a failure); eval planner's fallback_range has the same default
    fallback_range: tuple[str, str] = FALLBACK_RANGE

    def __post_init__(self) -> None:
        if self.k < 1 or self.planner_max_tokens < 1 or self.metadata_tokens < 1:
            raise ConfigError("smartchunk: k, planner_max_tokens and metadata_tokens must be >= 1")
        check_fallback_range(self.fallback_range, "smartchunk.fallback_range")


class SmartChunkStrategy:
    """Planner, then range search, then the generator.

    The planner reads one document's beginning (as it was trained: SmartChunk is QA over a given document). A
    question with a document scope (QASPER's paper) names it: the planner reads that document and the planned
    range is searched among its chunks only. Over an open corpus the question does not say which document it is
    about, so the document whose embedding is nearest the question is the one the planner reads, and the planned
    range is searched over the whole corpus (over a scope of several documents: the nearest of them, and their
    chunks).
    """

    name = "smartchunk"

    def __init__(self, retriever: SmartChunkRetriever, documents: dict[str, Document], config: SmartChunkConfig,
                 answer: AnswerConfig, tokenizer: Any = None):
        self.retriever, self.documents, self.config, self.answer_config = retriever, documents, config, answer
        self._tokenizer = tokenizer or load_tokenizer(config.tokenizer)

    def _derive(self, retriever: SmartChunkRetriever, documents: dict[str, Document]) -> SmartChunkStrategy:
        """A strategy over another retriever and documents, with this one's settings and tokenizer."""
        return SmartChunkStrategy(retriever, documents, self.config, self.answer_config, self._tokenizer)

    @classmethod
    def build(cls, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client, config: SmartChunkConfig,
              answer: AnswerConfig, *, embedding_model: str | None = None, settings: Mapping[str, Any] | None = None,
              compressor_model: str | None = None) -> SmartChunkStrategy:
        """Embed every chunk (``SmartChunkRetriever``); a save records ``embedding_model`` (the served embedder's
        model), ``settings`` (the hierarchy's) and, with ``upper: compressor``, ``compressor_model`` (the served
        compressor's)."""
        if not any(c.level == "document" for c in chunks):
            raise ConfigError("smartchunk needs the hierarchy's document level (hierarchy.levels)")
        retriever = SmartChunkRetriever(chunks, client, upper=config.upper, embedding_model=embedding_model,
                                        settings=settings, compressor_model=compressor_model)
        return cls(retriever, {d.id: d for d in documents}, config, answer)

    def save_index(self, folder: Path) -> None:
        """Every chunk's vector with a manifest (the embedding model, the hierarchy settings, how the vectors were
        made) in ``folder``: a part of a saved ``Retriever``, which keeps the documents."""
        self.retriever.save(folder)

    @classmethod
    def load_index(cls, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: SmartChunkConfig, answer: AnswerConfig, *, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None,
                   compressor_model: str | None = None) -> SmartChunkStrategy:
        """The strategy over ``documents`` and the vectors ``save_index`` wrote (with its own copy of the chunks:
        ``chunks`` is not read; ``SmartChunkRetriever.load`` checks them, and the served ``compressor_model``)."""
        retriever = SmartChunkRetriever.load(folder, client, config.upper, embedding_model, settings, compressor_model)
        return cls(retriever, {d.id: d for d in documents}, config, answer)

    def with_documents(self, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                       replace: bool = False) -> SmartChunkStrategy:
        """A strategy that also holds ``documents`` (their hierarchy ``chunks`` embedded through ``client``); this
        one is left as it was."""
        if missing := sorted({d.id for d in documents} - {c.doc_id for c in chunks if c.level == "document"}):
            raise ConfigError(f"smartchunk needs the document level of every added document: {', '.join(missing)}")
        retriever = self.retriever.with_documents(chunks, client, replace)
        return self._derive(retriever, {**self.documents, **{d.id: d for d in documents}})

    def without_documents(self, doc_ids: Iterable[str]) -> SmartChunkStrategy:
        """A strategy without the documents ``doc_ids`` (their chunks and vectors); this one is left as it was."""
        dropped = set(doc_ids)
        return self._derive(self.retriever.without_documents(dropped),
                            {i: d for i, d in self.documents.items() if i not in dropped})

    def max_evidence(self) -> int:
        """The most chunks one retrieval can return: every chunk of the hierarchy (the widest range the planner can
        plan, sentence..document)."""
        return len(self.retriever.chunks)

    def planner_document(self, question: str, scope: Sequence[str] | None, embed) -> Document:
        """The document the planner reads: the scope's one document, else the one (of the scope's, when given)
        whose document-level embedding is nearest the question. A scope naming a document outside the corpus is a
        ConfigError."""
        if scope is not None:
            if missing := [d for d in scope if d not in self.documents]:
                raise ConfigError(f"smartchunk: the question's document(s) {', '.join(missing)} are not in the corpus")
            if len(set(scope)) == 1:
                return self.documents[scope[0]]
        (top,) = self.retriever.index("document", "document").search([question], 1, embed=embed, doc_ids=scope)[0]
        return self.documents[top.chunk.doc_id]

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """Plan on the question's document (``scope``'s, when given) and search the planned range (among
        ``scope``'s chunks, when given): its top ``k`` chunks (``smartchunk.k`` when None) with their similarities;
        the plan is in the details."""
        def embed(texts: list[str]):
            return client.embed("embedder", texts)

        try:
            document = self.planner_document(question, scope, embed)
            metadata = document_metadata(document.title, document.text, self._tokenizer, self.config.metadata_tokens)
            reply = client.chat("planner", planner_messages(question, metadata),
                                max_tokens=self.config.planner_max_tokens, temperature=0)
            plan = parse_plan(reply.text)
            level_min, level_max = plan.levels or self.config.fallback_range
            hits = self.retriever.index(level_min, level_max).search([question], k or self.config.k, embed=embed,
                                                                     doc_ids=scope)[0]
        except ClientError as exc:
            raise_if_refused(exc, "SmartChunk's plan or retrieval (roles 'planner', 'embedder')")
            return Retrieval(failure="request_failed", failure_detail=str(exc))
        details = {"plan": [level_min, level_max], "planner_document": document.id}
        if not plan.valid:
            details.update(plan_unparsed=1, plan_error=plan.error, planner_raw=reply.text)
        return Retrieval([h.chunk for h in hits], [h.score for h in hits], details=details)

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Plan, search the planned range (``retrieve_evidence``) and answer from the top k."""
        found = self.retrieve_evidence(question, client, scope)
        if found.failure:
            return found.failed_answer()
        return found.scored(generate_answer(question, found.evidence, client, self.answer_config, **found.details))
