"""Orion-RAG's strategy: ``OrionStrategy`` indexes a tagged corpus three ways (dense over the semantic paths,
dense over the texts, BM25 over the texts; vectors cached in vectors.npz and checked against the embedder now
serving) and answers a question: rewrite, retrieve and fuse per sub-query, prune, answer (``query``). A question
with a document scope (QASPER's paper) is retrieved from those documents' chunks only, in all three indexes.

Updates (``with_documents`` / ``without_documents``, which ``Retriever`` swaps in) make a new strategy: an added
document is cut and tagged as the tagging job would (its chunking and tagging settings, read from the tags folder's
``chunks.settings.json``, the defaults without one) and only its paths and texts are embedded (the tags that fell
back to the tagger's own are counted in the new strategy's ``fallbacks``); a removed document's master tags, chunks
and vectors go. BM25 is rebuilt either way. ``save_index`` writes the tags, the vectors and a
manifest; ``load_index`` reads them back without a model call.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from overstory.core.config import ConfigError, build
from overstory.core.records import Chunk, Document, write_jsonl
from overstory.retrieval.answer import AnswerConfig, clean_answer
from overstory.retrieval.index import BM25Index, DenseIndex, chunk_text_for_index
from overstory.retrieval.index_manifest import (
    IndexMismatchError,
    check_contents,
    check_manifest,
    chunks_hash,
    read_manifest,
    write_manifest,
)
from overstory.retrieval.orion.query import (
    PRUNE_FORMAT,
    REWRITE_PROMPT,
    grouped_answer_messages,
    parse_pruned,
    parse_sub_queries,
    passage_sentences,
    prune_messages,
    rewrite_format,
    weighted_rrf,
)
from overstory.retrieval.orion.tagger import ChunkingConfig, Tagger, TaggingConfig, chunk_document
from overstory.retrieval.orion.tags import (
    CHUNKS_FILE,
    MASTERS_FILE,
    TAGS_SETTINGS_FILE,
    VECTORS_FILE,
    ChunkTags,
    DocumentTags,
    load_tags,
    semantic_path,
)
from overstory.retrieval.strategy import Retrieval, StrategyAnswer, raise_if_refused
from overstory.serving.client import Client, ClientError

# embedded at every build and kept in vectors.npz: when the embedder serving now gives it another vector, the cached
# vectors came from another embedder and are dropped
PROBE = "Orion-RAG embedder check: which embedder wrote these vectors?"
ORION_KIND = "orion"  # the kind a saved Orion-RAG index's manifest names


@dataclass(frozen=True)
class FusionWeights:
    """Weights of the three rankings in the weighted RRF (the paper's: paths 0.25, dense text 0.25, BM25 0.5)."""

    tag: float = 0.25  # dense over the semantic paths
    semantic: float = 0.25  # dense over the chunk texts
    sparse: float = 0.5  # BM25 over the chunk texts


@dataclass(frozen=True)
class OrionConfig:
    tags: str = ""  # the out folder of `overstory data orion-tags` over the same corpus
    rewrite_max: int = 3  # sub-queries the generator may add to the question (0: no rewriting call)
    rewrite_max_words: int = 12  # each sub-query is cut to this many words
    rewrite_max_tokens: int = 160
    weights: FusionWeights = field(default_factory=FusionWeights)
    rrf_k: int = 60  # the RRF constant: score = sum_i w_i / (rrf_k + rank_i), ranks from 1
    depth: int = 50  # hits each index ranks per sub-query before the fusion
    # chunks kept per sub-query after the fusion, each pruned; the answer prompt shows the first answer.context_chunks
    # that pruning kept, per sub-query
    top_k: int = 5
    prune: bool = True  # one generator call per (chunk, sub-query) keeps what helps the sub-query
    prune_max_tokens: int = 256
    concurrency: int = 4  # pruning requests in flight for one question
    max_query_chars: int = 1000  # the question and each sub-query are cut to this in every search and prompt
    embed_batch_size: int = 256

    def __post_init__(self) -> None:
        for key in ("rewrite_max_words", "rewrite_max_tokens", "depth", "top_k", "prune_max_tokens", "concurrency",
                    "max_query_chars", "embed_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"orion.{key} must be at least 1, got {getattr(self, key)}")
        for key in ("rewrite_max", "rrf_k"):
            if getattr(self, key) < 0:
                raise ConfigError(f"orion.{key} must be at least 0, got {getattr(self, key)}")
        for key, weight in asdict(self.weights).items():
            if weight < 0:
                raise ConfigError(f"orion.weights.{key} must be at least 0, got {weight}")
        if not any(asdict(self.weights).values()):
            raise ConfigError("orion.weights: at least one of tag, semantic, sparse must be positive")


def _embedded_by_the_strategy(texts: list[str]) -> np.ndarray:
    """The dense indexes' own query encoder, never called: the strategy embeds each question's sub-queries once,
    through that question's client, and hands the vectors to both indexes."""
    raise RuntimeError("OrionStrategy passes query vectors to its dense indexes")


def _replaced(records: list[ChunkTags], doc_id: str, new: Sequence[ChunkTags]) -> list[ChunkTags]:
    """``records`` with the document's chunks replaced by ``new``, placed where its first chunk was."""
    at = next((i for i, r in enumerate(records) if r.doc_id == doc_id), len(records))
    others = [r for r in records if r.doc_id != doc_id]
    before = sum(1 for r in records[:at] if r.doc_id != doc_id)
    return others[:before] + list(new) + others[before:]


class OrionStrategy:
    """Orion-RAG over a tagged corpus: ``build`` reads the tags and indexes them, ``answer`` runs a question."""

    name = "orion"

    def __init__(self, masters: dict[str, DocumentTags], records: Sequence[ChunkTags], config: OrionConfig,
                 answer: AnswerConfig, *, embedding_model: str | None = None, settings: Mapping[str, Any] | None = None,
                 tagging: Mapping[str, Any] | None = None):
        if not records:
            raise ConfigError("orion.tags: no tagged chunks to index")
        untagged = [r.id for r in records if r.doc_id not in masters]
        if untagged:
            raise ConfigError(f"orion.tags: the document of chunk {untagged[0]!r} has no master tags; finish the "
                              "tagging run (`overstory data orion-tags` resumes)")
        self.masters, self.records = dict(masters), list(records)
        self.config, self.answer_config = config, answer
        self.vectors: dict[str, np.ndarray] = {}  # every embedded path and text (and PROBE), by string
        self.embedded = 0  # strings embedded since construction (build, reindex_document)
        # what a save records: the served embedder's model, the hierarchy's settings, and the chunking and tagging
        # settings an added document is cut and tagged with ({"chunking": ..., "tagging": ...})
        self.embedding_model, self.settings = embedding_model, dict(settings or {})
        self.tagging = dict(tagging or {})
        # tags that fell back while this object tagged documents (with_documents): master_tags, paragraph_tags
        self.fallbacks: dict[str, int] = {}

    @classmethod
    def build(cls, client: Client, config: OrionConfig, answer: AnswerConfig | None = None, *,
              embedding_model: str | None = None, settings: Mapping[str, Any] | None = None) -> OrionStrategy:
        """The strategy over the tags in ``config.tags``; what vectors.npz there lacks (or all of it, when another
        embedder wrote it) is embedded through ``client``'s embedder. A save records ``embedding_model`` (the served
        embedder's model), ``settings`` (the hierarchy's) and the folder's chunking and tagging settings."""
        if not config.tags:
            raise ConfigError("orion.tags: name the out folder of `overstory data orion-tags` over this corpus")
        strategy = cls(*load_tags(config.tags), config, answer or AnswerConfig(), embedding_model=embedding_model,
                       settings=settings, tagging=_tagging_settings(config.tags))
        embed = _embedder(client)
        strategy.vectors = _trusted(load_vectors(config.tags), embed)
        strategy.embedded = strategy._embed_missing([s for r in strategy.records for s in strategy._strings(r)], embed)
        strategy._rebuild()
        return strategy

    def path(self, record: ChunkTags) -> str:
        return semantic_path(self.masters[record.doc_id].tags, record.tags)

    def _strings(self, record: ChunkTags) -> tuple[str, str]:
        """What is embedded for a chunk: its semantic path, and its text as every dense index embeds it."""
        return self.path(record), chunk_text_for_index(record.chunk())

    def _embed_missing(self, strings: Sequence[str], embed: Callable[[list[str]], np.ndarray]) -> int:
        """Embed the strings without a vector yet, in batches; returns how many."""
        missing = [s for s in dict.fromkeys(strings) if s not in self.vectors]
        size = self.config.embed_batch_size
        for i in range(0, len(missing), size):
            batch = missing[i: i + size]
            self.vectors.update(zip(batch, np.asarray(embed(batch), dtype=np.float32)))
        return len(missing)

    def _rebuild(self) -> None:
        """The three indexes over ``records``, every vector taken from ``vectors`` (no model call)."""
        chunks = [r.chunk() for r in self.records]
        paths = [self.path(r) for r in self.records]
        self.chunks = {c.id: c for c in chunks}
        self.path_index = DenseIndex([replace(c, text=p, title="") for c, p in zip(chunks, paths)],
                                     np.stack([self.vectors[p] for p in paths]), _embedded_by_the_strategy)
        self.text_index = DenseIndex(chunks, np.stack([self.vectors[chunk_text_for_index(c)] for c in chunks]),
                                     _embedded_by_the_strategy)
        self.bm25 = BM25Index.build(chunks)

    def reindex_document(self, doc_id: str, embed: Callable[[list[str]], np.ndarray],
                         master: DocumentTags | None = None, chunks: Sequence[ChunkTags] | None = None) -> int:
        """Give one document new master tags and/or new chunks and re-index it alone: only its paths and texts
        without a vector are embedded (a master-tag edit embeds its paths again, not its unchanged texts; no other
        document's row changes), and BM25, whose statistics are corpus-wide but need no model, is rebuilt from the
        texts. Returns how many strings were embedded."""
        if doc_id not in self.masters:
            raise KeyError(f"{doc_id!r} is not a document of this index")
        if master is not None:
            self.masters[doc_id] = master
        if chunks is not None:
            self.records = _replaced(self.records, doc_id, chunks)
        own = [s for r in self.records if r.doc_id == doc_id for s in self._strings(r)]
        embedded = self._embed_missing(own, embed)
        self.embedded += embedded
        self._rebuild()
        return embedded

    def save_vectors(self, folder: str | Path) -> Path:
        """Write the vectors of the current paths and texts (and PROBE) to ``folder``/vectors.npz, atomically."""
        used = [PROBE, *dict.fromkeys(s for r in self.records for s in self._strings(r))]
        path = Path(folder) / VECTORS_FILE
        partial = path.with_name("vectors.partial.npz")
        np.savez(partial, strings=np.array(used), vectors=np.stack([self.vectors[s] for s in used]))
        partial.replace(path)
        return path

    # ---- persistence and updates

    def _derive(self, masters: dict[str, DocumentTags], records: Sequence[ChunkTags]) -> OrionStrategy:
        """A strategy over ``masters`` and ``records`` with this one's settings and the vectors they use (and PROBE);
        its indexes are not built yet (``_rebuild``)."""
        derived = OrionStrategy(masters, records, self.config, self.answer_config,
                                embedding_model=self.embedding_model, settings=self.settings, tagging=self.tagging)
        used = {PROBE, *(s for r in derived.records for s in derived._strings(r))}
        derived.vectors = {s: v for s, v in self.vectors.items() if s in used}
        return derived

    def save_index(self, folder: Path) -> None:
        """The master tags, the tagged chunks, their vectors and a manifest (the chunks' corpus hash, the embedding
        model, the hierarchy and tagging settings) in ``folder``: a part of a saved ``Retriever``."""
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / MASTERS_FILE, self.masters.values())
        write_jsonl(folder / CHUNKS_FILE, self.records)
        self.save_vectors(folder)
        chunks = list(self.chunks.values())
        write_manifest(folder, {"kind": ORION_KIND, "corpus_hash": chunks_hash(chunks), "n_chunks": len(chunks),
                                "n_documents": len(self.masters), "embedding_model": self.embedding_model,
                                "settings": {"hierarchy": self.settings, "tagging": self.tagging}})

    @classmethod
    def load_index(cls, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: OrionConfig, answer: AnswerConfig, *, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None) -> OrionStrategy:
        """The strategy over the tags and vectors ``save_index`` wrote (Orion cuts its own chunks: ``documents`` and
        ``chunks`` are not read; ``config.tags`` neither), with no model call; refused (``IndexMismatchError``) for
        another embedding model or hierarchy settings, chunks that differ from those saved, or a missing vector."""
        manifest = read_manifest(folder)
        check_manifest(manifest, folder, embedding_model, {"hierarchy": dict(settings)} if settings is not None else {})
        recorded = manifest["settings"]
        strategy = cls(*load_tags(folder), config, answer, embedding_model=manifest.get("embedding_model"),
                       settings=recorded["hierarchy"], tagging=recorded["tagging"])
        saved = [r.chunk() for r in strategy.records]
        check_contents(manifest, folder, ORION_KIND, len(saved), chunks_hash(saved))
        strategy.vectors = load_vectors(folder)
        if missing := [s for r in strategy.records for s in strategy._strings(r) if s not in strategy.vectors]:
            raise IndexMismatchError(f"{folder}: {VECTORS_FILE} has no vector for {len(missing)} path(s) or text(s), "
                                     f"e.g. {missing[0][:80]!r}")
        strategy._rebuild()
        return strategy

    def with_documents(self, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                       replace: bool = False) -> OrionStrategy:
        """A strategy that also holds ``documents``: cut into windows and tagged through ``client``'s generator with
        this index's chunking and tagging settings (the tags that fell back counted in its ``fallbacks``), their
        paths and texts alone embedded (``chunks``, the hierarchy, is not read: Orion cuts its own); with ``replace``
        their old tags go first. This strategy is left as it was."""
        chunking = build(ChunkingConfig, dict(self.tagging.get("chunking", {})), prefix="chunking.")
        tagger = Tagger(client, build(TaggingConfig, dict(self.tagging.get("tagging", {})), prefix="tagging."))
        ids = {d.id for d in documents}
        masters = {i: m for i, m in self.masters.items() if not (replace and i in ids)}
        records = [r for r in self.records if not (replace and r.doc_id in ids)]
        master_tags = [tagger.master(d) for d in documents]
        paragraph_tags = [tagger.paragraph(c) for d in documents for c in chunk_document(d, chunking)]
        masters.update({d.id: tagged.record for d, tagged in zip(documents, master_tags)})
        added = [tagged.record for tagged in paragraph_tags]
        derived = self._derive(masters, [*records, *added])
        derived.embedded = derived._embed_missing([s for r in added for s in derived._strings(r)], _embedder(client))
        derived.fallbacks = {"master_tags": sum(t.failure is not None for t in master_tags),
                             "paragraph_tags": sum(t.failure is not None for t in paragraph_tags)}
        derived._rebuild()
        return derived

    def without_documents(self, doc_ids: Iterable[str]) -> OrionStrategy:
        """A strategy without the master tags, chunks and vectors of ``doc_ids``; this one is left as it was."""
        dropped = set(doc_ids)
        derived = self._derive({i: m for i, m in self.masters.items() if i not in dropped},
                               [r for r in self.records if r.doc_id not in dropped])
        derived._rebuild()
        return derived

    # ---- a question

    def max_evidence(self) -> int:
        """The most chunks one retrieval can return: every tagged chunk of the index."""
        return len(self.chunks)

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """Rewrite, then retrieve and fuse per sub-query (from ``scope``'s documents only, when given): the chunks
        once each by their best fused score (the first ``k``, when given), the sub-queries and each one's fused
        chunk ids in the details. A scope naming a document the tags lack raises ConfigError."""
        if scope is not None and (missing := [d for d in scope if d not in self.masters]):
            raise ConfigError(f"orion.tags has no document {', '.join(missing)}: tag the corpus evaluated")
        sub_queries, details = self._sub_queries(question[: self.config.max_query_chars], client)
        try:
            fused = self.retrieve(sub_queries, client, scope)
        except ClientError as exc:
            raise_if_refused(exc, "Orion-RAG's query embedding (role 'embedder')")
            return Retrieval(failure="request_failed", failure_detail=str(exc), details=details)
        best = self._best_first(fused)
        details.update(retrieved=len(best), fused=[[cid for cid, _ in hits] for hits in fused])
        best = best[:k] if k else best
        return Retrieval([self.chunks[cid] for cid, _ in best], [score for _, score in best], details=details)

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Rewrite, retrieve and fuse per sub-query (``retrieve_evidence``), prune, answer from the evidence grouped
        per sub-query; every call through ``client``. Never raises for a bad reply or a transient request failure
        (counted, or the question's recorded failure); a request the server refuses (a 4xx: a wrong role or model
        name) raises ``RequestRefused``, since every question would fail alike; a scope naming a document the tags
        lack raises ConfigError."""
        found = self.retrieve_evidence(question, client, scope)
        if found.failure:
            return found.failed_answer()
        details = found.details
        sub_queries, fused = details["sub_queries"], details["fused"]
        texts, counts = self._prune([(q, self.chunks[cid]) for q, ids in zip(sub_queries, fused) for cid in ids],
                                    client)
        details.update(counts)
        messages = grouped_answer_messages(question[: self.config.max_query_chars],
                                           self._groups(sub_queries, fused, texts), self.answer_config.max_chunk_chars)
        try:
            reply = client.chat("generator", messages, max_tokens=self.answer_config.max_tokens, temperature=0)
        except ClientError as exc:
            raise_if_refused(exc, "Orion-RAG's answer (role 'generator')")
            return StrategyAnswer("", "", found.evidence, failure="request_failed", failure_detail=str(exc),
                                  details=details)
        prediction = clean_answer(reply.text)
        failure = {} if prediction else {"failure": "no_answer", "failure_detail": reply.text}
        return found.scored(StrategyAnswer(prediction, reply.text, found.evidence, details=details, **failure))

    def _groups(self, sub_queries: Sequence[str], fused: list[list[str]], texts: Sequence[str]
                ) -> list[tuple[str, list[tuple[Chunk, str]]]]:
        """Each sub-query with the first ``answer.context_chunks`` of its chunks (``fused``: each sub-query's chunk
        ids) that pruning kept (``texts`` holds the pruned texts of every (sub-query, chunk) pair, in order);
        sub-queries left with none are left out."""
        groups, at = [], 0
        for query, ids in zip(sub_queries, fused):
            kept = [(self.chunks[cid], text) for cid, text in zip(ids, texts[at: at + len(ids)]) if text]
            if kept[: self.answer_config.context_chunks]:
                groups.append((query, kept[: self.answer_config.context_chunks]))
            at += len(ids)
        return groups

    def _sub_queries(self, question: str, client: Client) -> tuple[list[str], dict[str, Any]]:
        """The question and the generator's rewrites of it; an unusable reply or a failed request leaves the question
        alone, counted in the details (with the raw reply)."""
        details: dict[str, Any] = {"rewrite_unparsed": 0, "rewrite_failures": 0}
        n, words = self.config.rewrite_max, self.config.rewrite_max_words
        rewrites: list[str] = []
        if n:
            prompt = REWRITE_PROMPT.format(n=n, words=words, question=question)
            try:
                reply = client.chat("generator", [{"role": "user", "content": prompt}],
                                    response_format=rewrite_format(n, words),
                                    max_tokens=self.config.rewrite_max_tokens, temperature=0)
            except ClientError as exc:
                raise_if_refused(exc, "Orion-RAG's query rewrite (role 'generator')")
                details.update(rewrite_failures=1, rewrite_raw=str(exc))
            else:
                parsed = parse_sub_queries(reply.text, question, n, words)
                if parsed is None:
                    details.update(rewrite_unparsed=1, rewrite_raw=reply.text)
                rewrites = [q[: self.config.max_query_chars] for q in parsed or []]
        details["sub_queries"] = [question, *rewrites]
        return [question, *rewrites], details

    def retrieve(self, sub_queries: Sequence[str], client: Client, scope: Sequence[str] | None = None
                 ) -> list[list[tuple[str, float]]]:
        """Per sub-query, the top ``top_k`` chunk ids (of ``scope``'s documents only, when given) with their fused
        scores. The sub-queries are embedded in one request through ``client``; BM25 hits of score 0 (no query word
        in the chunk) are no ranking at all."""
        vectors = client.embed("embedder", list(sub_queries))
        depth = max(self.config.depth, self.config.top_k)
        tag = self.path_index.search(sub_queries, depth, embed=lambda texts: vectors, doc_ids=scope)
        semantic = self.text_index.search(sub_queries, depth, embed=lambda texts: vectors, doc_ids=scope)
        sparse = self.bm25.search(sub_queries, depth, doc_ids=scope)
        weights = asdict(self.config.weights)
        return [weighted_rrf({"tag": [h.chunk.id for h in t], "semantic": [h.chunk.id for h in s],
                              "sparse": [h.chunk.id for h in b if h.score > 0]}, weights, self.config.rrf_k)
                [: self.config.top_k] for t, s, b in zip(tag, semantic, sparse)]

    def _best_first(self, fused: list[list[tuple[str, float]]]) -> list[tuple[str, float]]:
        """The retrieved chunk ids once each with their best fused score over the sub-queries (fused scores of
        different sub-queries share one scale), best first; ties in the order met."""
        best: dict[str, float] = {}
        for hits in fused:
            for cid, score in hits:
                best[cid] = max(best.get(cid, score), score)
        return sorted(best.items(), key=lambda item: -item[1])

    def _prune(self, pairs: list[tuple[str, Chunk]], client: Client) -> tuple[list[str], dict[str, int]]:
        """The text each (sub-query, chunk) pair shows the generator, in order ("" when pruning dropped it), and the
        pruning counts. A failed or unreadable pruning reply keeps the whole chunk."""
        if not self.config.prune:
            return [chunk.text for _, chunk in pairs], {"prune_calls": 0}
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            outcomes = list(pool.map(lambda pair: self._prune_one(*pair, client), pairs))
        kinds = Counter(kind for _, kind in outcomes)
        counts = {"prune_calls": len(pairs), "pruned_dropped": kinds["dropped"],
                  "prune_unparsed": kinds["unparsed"], "prune_failures": kinds["failed"]}
        return [text for text, _ in outcomes], counts

    def _prune_one(self, query: str, chunk: Chunk, client: Client) -> tuple[str, str]:
        """(the text to show, what happened: pruned, dropped, unparsed or failed)."""
        sentences = passage_sentences(chunk.text[: self.answer_config.max_chunk_chars])
        try:
            reply = client.chat("generator", prune_messages(query, chunk, sentences), response_format=PRUNE_FORMAT,
                                max_tokens=self.config.prune_max_tokens, temperature=0)
        except ClientError as exc:
            raise_if_refused(exc, "Orion-RAG's pruning (role 'generator')")
            return chunk.text, "failed"
        pruned = parse_pruned(reply.text, sentences)
        if pruned is None:
            return chunk.text, "unparsed"
        return pruned, "pruned" if pruned else "dropped"


def _embedder(client: Client) -> Callable[[list[str]], np.ndarray]:
    return lambda texts: client.embed("embedder", texts)


def load_vectors(folder: str | Path) -> dict[str, np.ndarray]:
    """The cached vectors in ``folder``/vectors.npz by string; {} when there is no such file."""
    path = Path(folder) / VECTORS_FILE
    if not path.is_file():
        return {}
    with np.load(path, allow_pickle=False) as stored:
        return dict(zip(stored["strings"].tolist(), stored["vectors"]))


def _trusted(cached: dict[str, np.ndarray], embed: Callable[[list[str]], np.ndarray]) -> dict[str, np.ndarray]:
    """The cached vectors when the embedder serving now gives ``PROBE`` the vector they hold for it (cosine above
    0.999: batching moves the last digits); else only the probe's new vector, so everything is embedded again."""
    fresh = np.asarray(embed([PROBE]), dtype=np.float32)[0]
    old = cached.get(PROBE)
    if old is not None and old.shape == fresh.shape:
        cosine = float(old @ fresh / max(np.linalg.norm(old) * np.linalg.norm(fresh), 1e-12))
        if cosine > 0.999:
            return dict(cached)
    return {PROBE: fresh}


def _tagging_settings(folder: str | Path) -> dict[str, Any]:
    """The chunking and tagging settings the tagging job recorded in ``folder`` (``{"chunking", "tagging"}``); {}
    (the defaults) when it recorded none."""
    path = Path(folder) / TAGS_SETTINGS_FILE
    if not path.is_file():
        return {}
    recorded = json.loads(path.read_text())
    return {key: recorded[key] for key in ("chunking", "tagging") if key in recorded}
