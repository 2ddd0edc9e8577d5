"""Orion-RAG (arXiv 2601.04764, "Orion-RAG: Path-Aligned Hybrid Retrieval for Graphless Data") as a retrieval strategy.

Index (``retrieval/orion_tagger.py``). Each document is cut into sliding windows of characters (``window_spans``:
``chunk_chars`` 500 by default; the paper found 2,000 better for generation on Wikipedia text, a setting). The
``generator`` tags each document with up to ``max_master_tags`` master tags, read from its title and start, and each
chunk with exactly three paragraph tags of 1-4 words (gist, subjects, domain), through json_schema structured
outputs (``Tagger``). A reply that stays
unusable after ``max_attempts`` gets deterministic tags made of the text's own words (``source="fallback"``) and a
failure record with the raw reply, so no chunk is lost. A chunk's semantic path joins both layers
(``semantic_path``: "Master tag, master tag > gist > subjects > domain"). Three indexes cover the chunks: dense over
the paths (``tag``), dense over the texts (``semantic``) and BM25 over the texts (``sparse``).

Query. The generator rewrites the question into at most ``rewrite_max`` sub-queries of at most
``rewrite_max_words`` words (the question itself always searches too); each sub-query ranks the chunks in the three
indexes, fused by weighted reciprocal rank fusion (``weighted_rrf``, weights 0.25 / 0.25 / 0.5) into its top
``top_k``; one generator call per (chunk, sub-query) prunes the chunk to what helps that sub-query (an empty
reply drops it from the prompt); the generator answers from the pruned evidence grouped per sub-query.

Files. ``overstory data orion-tags`` (data_pipeline/orion_tags.py) writes, in its ``out`` folder, masters.jsonl
(``DocumentTags``), chunks.jsonl (``ChunkTags``: each chunk's text and document offsets with its tags, so the
strategy needs nothing else) and vectors.npz (the embeddings of paths and texts: a cache, whatever it lacks is
embedded at build). ``overstory data orion-tags-edit`` changes one document's master tags and re-indexes that
document alone (``OrionStrategy.reindex_document``). The tagging itself lives here, below data_pipeline
(tests/test_layers.py), as LATTICE's keyword summaries do.

Configs: ``OrionConfig`` for the strategy (the evaluation harness builds it); the tagging job's is
configs/data/orion_tags.yaml.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, read_jsonl
from overstory.models.json_reply import json_objects, loads_tolerant
from overstory.retrieval.answer import ANSWER_EXAMPLE, ANSWER_SYSTEM_PROMPT, clean_answer
from overstory.retrieval.index import BM25Index, DenseIndex, chunk_text_for_index
from overstory.retrieval.naive import AnswerConfig
from overstory.retrieval.strategy import StrategyAnswer
from overstory.serving.client import Client, ClientError

MASTERS_FILE, CHUNKS_FILE, VECTORS_FILE = "masters.jsonl", "chunks.jsonl", "vectors.npz"
PARAGRAPH_TAGS = ("gist", "subjects", "domain")
TAG_MAX_WORDS = 4
TAG_MAX_WORD_CHARS = 20  # a tag word's cap in the reply schemas (longer is a run-on, not a word)
QUERY_CHARS_PER_WORD = 10  # a sub-query's cap in the rewrite schema: rewrite_max_words at this many characters
PATH_SEPARATOR = " > "
# embedded at every build and kept in vectors.npz: when the embedder serving now gives it another vector, the cached
# vectors came from another embedder and are dropped
PROBE = "Orion-RAG embedder check: which embedder wrote these vectors?"
# what a small model copies from the tagging prompts instead of tagging (its labels and placeholders); never a tag
PROMPT_LABELS = frozenset({"title", "start of the document", "document", "passage", "tag", "tags", "gist",
                           "subjects", "domain", "none"})


# ----------------------------------------------------------------------------------------------------- configs


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


# ----------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DocumentTags:
    """A document's master tags; ``source`` is "llm", "fallback" or "human" (set by orion-tags-edit)."""

    id: str  # the document's id
    title: str
    tags: list[str]
    source: str


@dataclass(frozen=True)
class ChunkTags:
    """A chunk with its paragraph tags (gist, subjects, domain): its text and document offsets are stored with it,
    so the strategy builds from the tag files alone and its chunks match gold evidence spans."""

    id: str
    doc_id: str
    title: str
    text: str
    start: int
    end: int
    tags: list[str]
    source: str  # "llm" or "fallback"

    def chunk(self) -> Chunk:
        return Chunk(id=self.id, doc_id=self.doc_id, level="paragraph", text=self.text, parent=None, children=[],
                     start=self.start, end=self.end, n_tokens=estimate_tokens(self.text), title=self.title)


def load_tags(folder: str | Path) -> tuple[dict[str, DocumentTags], list[ChunkTags]]:
    """The master tags (by document id) and the tagged chunks in ``folder``, as the tagging job wrote them."""
    folder = Path(folder)
    if not (folder / CHUNKS_FILE).is_file() or not (folder / MASTERS_FILE).is_file():
        raise ConfigError(f"orion.tags: {folder} holds no {MASTERS_FILE} and {CHUNKS_FILE}; write them with "
                          "`overstory data orion-tags`")
    masters = {record.id: record for record in read_jsonl(folder / MASTERS_FILE, DocumentTags)}
    return masters, list(read_jsonl(folder / CHUNKS_FILE, ChunkTags))


# ---------------------------------------------------------------------------------------------------- chunking


def estimate_tokens(text: str) -> int:
    """Tokens without a tokenizer (4/3 a word, typical of BPE on English), as LATTICE's prompt budget estimates."""
    return math.ceil(len(text.split()) * 4 / 3)


# ------------------------------------------------------------------------------------------------------- tags


def semantic_path(master_tags: Sequence[str], paragraph_tags: Sequence[str]) -> str:
    """A chunk's semantic path: its document's master tags, then its gist, subjects and domain.

    >>> semantic_path(["Marie Curie", "Radioactivity"], ["Curie finds polonium", "Marie Curie", "Chemistry"])
    'Marie Curie, Radioactivity > Curie finds polonium > Marie Curie > Chemistry'
    """
    return PATH_SEPARATOR.join([", ".join(master_tags), *paragraph_tags])


def distinct(tags: Iterable[str]) -> list[str]:
    """Non-empty tags, the first of those equal but for case."""
    seen, kept = set(), []
    for tag in tags:
        if tag and tag.lower() not in seen:
            seen.add(tag.lower())
            kept.append(tag)
    return kept


def reply_object(text: str, key: str) -> dict | None:
    """The last JSON object in a reply that holds ``key`` (read tolerantly); None when there is none."""
    return next((obj for obj in map(loads_tolerant, reversed(json_objects(text))) if obj is not None and key in obj),
                None)


def json_format(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


PRUNE_FORMAT = json_format("pruned", {"relevant": {"type": "string"}})


# ------------------------------------------------------------------------------------------------- retrieval


def weighted_rrf(rankings: dict[str, Sequence[str]], weights: dict[str, float], k: int = 60
                 ) -> list[tuple[str, float]]:
    """Weighted reciprocal rank fusion: score(d) = sum over rankings i of w_i / (k + rank_i(d)), ranks from 1 (the
    best hit of a ranking has rank 1); a ranking without d adds nothing. Best first; ties keep the order in which
    ids were first met (rankings in their dict order). A ranking weighted 0 is left out (its ids do not enter with
    score 0); an id repeated within a ranking counts at its first rank.

    >>> fused = weighted_rrf({"tag": ["a", "b"], "sparse": ["b", "c"]}, {"tag": 0.25, "sparse": 0.5})
    >>> [(d, round(score, 6)) for d, score in fused]  # b: 0.25/62 + 0.5/61; c: 0.5/62; a: 0.25/61
    [('b', 0.012229), ('c', 0.008065), ('a', 0.004098)]
    """
    missing = [name for name in rankings if name not in weights]
    if missing:
        raise ValueError(f"no weight for the ranking {missing[0]!r}; weights: {', '.join(weights)}")
    scores: dict[str, float] = {}
    for name, ranking in rankings.items():
        if weights[name] == 0:
            continue
        for rank, doc_id in enumerate(dict.fromkeys(ranking), 1):
            scores[doc_id] = scores.get(doc_id, 0.0) + weights[name] / (k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])


REWRITE_PROMPT = """Split the question below into at most {n} short search queries of at most {words} words each \
that together find every fact needed to answer it: one query per fact or entity, for a question that chains facts \
one query per step.

Question: {question}

Reply with one JSON object: {{"queries": ["...", "..."]}}."""

PRUNE_SYSTEM_PROMPT = ("You filter a retrieved passage for a search query. Copy, word for word, only the sentences of "
                       "the passage that help answer the query. If no sentence helps, give an empty string.")


def rewrite_format(max_queries: int, max_words: int) -> dict[str, Any]:
    """The rewrite reply schema: 1 to ``max_queries`` non-empty strings, each within ``max_words`` words' characters."""
    query = {"type": "string", "minLength": 1, "maxLength": max_words * QUERY_CHARS_PER_WORD}
    return json_format("sub_queries", {"queries": {"type": "array", "items": query, "minItems": 1,
                                                    "maxItems": max_queries}})


def parse_sub_queries(text: str, question: str, max_queries: int, max_words: int) -> list[str] | None:
    """The rewrites in a reply, each cut to ``max_words`` words, distinct and other than the question, at most
    ``max_queries``; None when the reply is unusable (no "queries" list holding a string with words).

    >>> parse_sub_queries('{"queries": ["Who directed Alien?", "who directed alien?", "Alien director birth year"]}',
    ...                   "Where was the director of Alien born?", 3, 3)
    ['Who directed Alien?', 'Alien director birth']
    >>> parse_sub_queries('{"queries": [""]}', "q", 3, 12) is None, parse_sub_queries("Alien", "q", 3, 12) is None
    (True, True)
    """
    reply = reply_object(text, "queries")
    values = reply["queries"] if reply is not None and isinstance(reply["queries"], list) else []
    queries = [" ".join(value.split()[:max_words]) for value in values if isinstance(value, str) and value.split()]
    if not queries:
        return None
    return [q for q in distinct(queries) if q.lower() != question.strip().lower()][:max_queries]


def parse_pruned(text: str) -> str | None:
    """The kept text of a pruning reply ("" drops the chunk); None when the reply holds no "relevant" string.

    >>> parse_pruned('{"relevant": " Paris is in France. "}'), parse_pruned('{"relevant": ""}'), parse_pruned("Paris")
    ('Paris is in France.', '', None)
    """
    reply = reply_object(text, "relevant")
    return reply["relevant"].strip() if reply is not None and isinstance(reply["relevant"], str) else None


def prune_messages(query: str, chunk: Chunk, max_chars: int) -> list[dict[str, str]]:
    title = f" ({chunk.title})" if chunk.title else ""
    return [{"role": "system", "content": PRUNE_SYSTEM_PROMPT},
            {"role": "user", "content": f"Query: {query}\n\nPassage{title}: {chunk.text[:max_chars]}\n\nReply with one "
                                        'JSON object: {"relevant": "the helpful sentences, or an empty string"}'}]


def grouped_answer_messages(question: str, groups: Sequence[tuple[str, Sequence[tuple[Chunk, str]]]],
                            max_chunk_chars: int) -> list[dict[str, str]]:
    """The shared answer prompt (``retrieval.answer``: system prompt, worked example) with the context grouped under
    each sub-query. A chunk keeps one number throughout; met again with the same text, it is only named.

    >>> c = Chunk("c", "d", "paragraph", "Paris is in France.", None, [], 0, 19, 5, "Paris")
    >>> print(grouped_answer_messages("Where is Paris?", [("Paris country", [(c, c.text)]), ("capital", [(c, c.text)])],
    ...                               100)[-1]["content"])
    Context:
    Sub-query 1: Paris country
    [1] Paris: Paris is in France.
    <BLANKLINE>
    Sub-query 2: capital
    [1] (as above)
    <BLANKLINE>
    Question: Where is Paris?
    Answer:
    """
    numbers: dict[str, int] = {}
    shown: set[tuple[str, str]] = set()
    blocks = []
    for i, (query, members) in enumerate(groups, 1):
        lines = [f"Sub-query {i}: {query}"]
        for chunk, text in members:
            n = numbers.setdefault(chunk.id, len(numbers) + 1)
            text = text[:max_chunk_chars]
            if (chunk.id, text) in shown:
                lines.append(f"[{n}] (as above)")
            else:
                shown.add((chunk.id, text))
                lines.append(f"[{n}] {chunk.title}: {text}" if chunk.title else f"[{n}] {text}")
        blocks.append("\n".join(lines))
    context = "\n\n".join(blocks)
    return [{"role": "system", "content": ANSWER_SYSTEM_PROMPT}, *ANSWER_EXAMPLE,
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"}]


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
                 answer: AnswerConfig):
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

    @classmethod
    def build(cls, client: Client, config: OrionConfig, answer: AnswerConfig | None = None) -> OrionStrategy:
        """The strategy over the tags in ``config.tags``; what vectors.npz there lacks (or all of it, when another
        embedder wrote it) is embedded through ``client``'s embedder."""
        if not config.tags:
            raise ConfigError("orion.tags: name the out folder of `overstory data orion-tags` over this corpus")
        strategy = cls(*load_tags(config.tags), config, answer or AnswerConfig())
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

    # ---- a question

    def answer(self, question: str, client: Client) -> StrategyAnswer:
        """Rewrite, retrieve and fuse per sub-query, prune, answer from the evidence grouped per sub-query; every call
        through ``client``. Never raises for a bad reply or a failed request."""
        question = question[: self.config.max_query_chars]
        sub_queries, details = self._sub_queries(question, client)
        try:
            fused = self.retrieve(sub_queries, client)
        except ClientError as exc:
            return StrategyAnswer("", "", failure="request_failed", failure_detail=str(exc), details=details)
        evidence = self._best_first(fused)
        texts, counts = self._prune([(q, self.chunks[cid]) for q, hits in zip(sub_queries, fused) for cid, _ in hits],
                                    client)
        details.update(counts, retrieved=len(evidence), fused=[[cid for cid, _ in hits] for hits in fused])
        messages = grouped_answer_messages(question, self._groups(sub_queries, fused, texts),
                                           self.answer_config.max_chunk_chars)
        try:
            reply = client.chat("generator", messages, max_tokens=self.answer_config.max_tokens, temperature=0)
        except ClientError as exc:
            return StrategyAnswer("", "", evidence, failure="request_failed", failure_detail=str(exc), details=details)
        prediction = clean_answer(reply.text)
        failure = {} if prediction else {"failure": "no_answer", "failure_detail": reply.text}
        return StrategyAnswer(prediction, reply.text, evidence, details=details, **failure)

    def _groups(self, sub_queries: Sequence[str], fused: list[list[tuple[str, float]]], texts: Sequence[str]
                ) -> list[tuple[str, list[tuple[Chunk, str]]]]:
        """Each sub-query with the first ``answer.context_chunks`` of its chunks that pruning kept (``texts`` holds
        the pruned texts of every (sub-query, chunk) pair, in order); sub-queries left with none are left out."""
        groups, at = [], 0
        for query, hits in zip(sub_queries, fused):
            kept = [(self.chunks[cid], text) for (cid, _), text in zip(hits, texts[at: at + len(hits)]) if text]
            if kept[: self.answer_config.context_chunks]:
                groups.append((query, kept[: self.answer_config.context_chunks]))
            at += len(hits)
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
                details.update(rewrite_failures=1, rewrite_raw=str(exc))
            else:
                parsed = parse_sub_queries(reply.text, question, n, words)
                if parsed is None:
                    details.update(rewrite_unparsed=1, rewrite_raw=reply.text)
                rewrites = [q[: self.config.max_query_chars] for q in parsed or []]
        details["sub_queries"] = [question, *rewrites]
        return [question, *rewrites], details

    def retrieve(self, sub_queries: Sequence[str], client: Client) -> list[list[tuple[str, float]]]:
        """Per sub-query, the top ``top_k`` chunk ids with their fused scores. The sub-queries are embedded in one
        request through ``client``; BM25 hits of score 0 (no query word in the chunk) are no ranking at all."""
        vectors = client.embed("embedder", list(sub_queries))
        depth = max(self.config.depth, self.config.top_k)
        tag = self.path_index.search(sub_queries, depth, embed=lambda texts: vectors)
        semantic = self.text_index.search(sub_queries, depth, embed=lambda texts: vectors)
        sparse = self.bm25.search(sub_queries, depth)
        weights = asdict(self.config.weights)
        return [weighted_rrf({"tag": [h.chunk.id for h in t], "semantic": [h.chunk.id for h in s],
                              "sparse": [h.chunk.id for h in b if h.score > 0]}, weights, self.config.rrf_k)
                [: self.config.top_k] for t, s, b in zip(tag, semantic, sparse)]

    def _best_first(self, fused: list[list[tuple[str, float]]]) -> list[Chunk]:
        """The retrieved chunks once each, by their best fused score over the sub-queries (fused scores of different
        sub-queries share one scale); ties in the order met."""
        best: dict[str, float] = {}
        for hits in fused:
            for cid, score in hits:
                best[cid] = max(best.get(cid, score), score)
        return [self.chunks[cid] for cid in sorted(best, key=lambda cid: -best[cid])]

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
        try:
            reply = client.chat("generator", prune_messages(query, chunk, self.answer_config.max_chunk_chars),
                                response_format=PRUNE_FORMAT, max_tokens=self.config.prune_max_tokens, temperature=0)
        except ClientError:
            return chunk.text, "failed"
        pruned = parse_pruned(reply.text)
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
