"""SmartChunk retrieval: search only the chunks whose level lies in the planner's range.

Embeddings of every chunk are computed once, bottom-up: the levels in ``direct_levels`` (sentences
by default) are embedded directly by the ``embedder`` role; every level above is embedded by the
``compressor`` role from its children's embeddings, e_comp = S(emb(c_1), ..., emb(c_m)), so no LLM
summary is needed at indexing time. ``upper="direct"`` embeds every level directly instead (the
``direct_encode`` baseline). A query for a level range then searches the matching subset.

``answer`` adds the generator on top; it is what the planner's QA reward calls for a predicted range.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

import numpy as np

from overstory.data_pipeline.formats import LEVEL_RANK, Chunk, check_level, level_range
from overstory.retrieval.answer import answer_messages
from overstory.retrieval.index import DenseIndex, Hit, chunk_text_for_index
from overstory.serving.client import ChatResult, Client


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
