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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import LEVEL_RANK, Chunk, Document, check_level, level_range
from overstory.models.planner import document_metadata, parse_plan, planner_messages
from overstory.models.registry import SMOLLM2, load_tokenizer
from overstory.retrieval.answer import AnswerConfig, answer_messages, generate_answer
from overstory.retrieval.index import DenseIndex, Hit, chunk_text_for_index
from overstory.retrieval.strategy import Retrieval, StrategyAnswer, raise_if_refused
from overstory.serving.client import ChatResult, Client, ClientError

# The range searched when a planner's reply has no usable plan: one setting for the runtime (``SmartChunkConfig``)
# and for ``eval planner``, which answers through the same runtime. sentence..paragraph is the most common label of
# the planner mix and the fixed range that scores best on its training questions, at about half the tokens that
# sentence..document reads (whose top k can be whole documents).
FALLBACK_RANGE: tuple[str, str] = ("sentence", "paragraph")


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
    def __init__(self, chunks: Sequence[Chunk], client: Client, upper: Literal["compressor", "direct"] = "compressor",
                 direct_levels: Sequence[str] = ("sentence",), batch_size: int = 256):
        self.client = client
        self.chunks = list(chunks)
        direct = {check_level(level) for level in direct_levels}
        self.embeddings = self._embed_bottom_up(direct if upper == "compressor" else set(LEVEL_RANK), batch_size)
        self._indexes: dict[tuple[str, str], DenseIndex] = {}

    def _embed_bottom_up(self, direct: set[str], batch_size: int) -> dict[str, np.ndarray]:
        vectors: dict[str, np.ndarray] = {}
        for level in sorted(LEVEL_RANK, key=LEVEL_RANK.get):  # children before parents
            at_level = [c for c in self.chunks if c.level == level]
            for start in range(0, len(at_level), batch_size):
                batch = at_level[start:start + batch_size]
                if level in direct or not batch[0].children:
                    rows = self.client.embed("embedder", [chunk_text_for_index(c) for c in batch])
                else:
                    rows = self.client.compress("compressor", embeddings=[
                        np.stack([vectors[child] for child in c.children]) for c in batch])
                vectors.update(zip((c.id for c in batch), rows))
        return vectors

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
        """Retrieve the top-k chunks of the range and let the generator answer from them."""
        chunks = [hit.chunk for hit in self.retrieve([question], level_min, level_max, k)[0]]
        reply = self.client.chat("generator", answer_messages(question, chunks, max_chunk_chars=1500),
                                 max_tokens=max_tokens, temperature=0)
        return reply, chunks


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
                 answer: AnswerConfig):
        self.retriever, self.documents, self.config, self.answer_config = retriever, documents, config, answer
        self._tokenizer = load_tokenizer(config.tokenizer)

    @classmethod
    def build(cls, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client, config: SmartChunkConfig,
              answer: AnswerConfig) -> SmartChunkStrategy:
        if not any(c.level == "document" for c in chunks):
            raise ConfigError("smartchunk needs the hierarchy's document level (hierarchy.levels)")
        return cls(SmartChunkRetriever(chunks, client, upper=config.upper), {d.id: d for d in documents}, config,
                   answer)

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
