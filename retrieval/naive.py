"""The naive strategy: the top-k chunks of one flat index go to the generator. The baseline of every comparison.

It is ``overstory eval rag`` as a strategy of the evaluation harness: same index kinds, same answer prompt.

Its index is one flat index (retrieval/index.py), so it persists and updates as those do: ``save_index`` writes it
with its manifest (the served embedder's model, the hierarchy settings and levels), ``load_index`` checks them, and
``with_documents`` / ``without_documents`` return a strategy over the updated index (only the new chunks embedded,
BM25 rebuilt) for ``Retriever`` (retrieval/api.py) to swap in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document, check_level
from overstory.retrieval.answer import AnswerConfig, generate_answer
from overstory.retrieval.index import INDEX_CLASSES, IndexKind, build_index
from overstory.retrieval.index_manifest import IndexMismatchError, read_index_files, write_index_files
from overstory.retrieval.strategy import Retrieval, StrategyAnswer, raise_if_refused
from overstory.serving.client import Client, ClientError


@dataclass(frozen=True)
class NaiveConfig:
    index: IndexKind = "hybrid"
    levels: list[str] = field(default_factory=lambda: ["paragraph"])
    k: int = 5  # chunks retrieved (recall@k is measured on them); the first answer.context_chunks are read

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"naive.k must be at least 1, got {self.k}")
        for level in self.levels:
            try:
                check_level(level)
            except ValueError as exc:
                raise ConfigError(f"naive.levels: {exc}") from exc


class NaiveStrategy:
    name = "naive"

    def __init__(self, index, config: NaiveConfig, answer: AnswerConfig):
        self.index, self.config, self.answer_config = index, config, answer

    @classmethod
    def build(cls, chunks: Sequence[Chunk], client: Client, config: NaiveConfig, answer: AnswerConfig, *,
              embedding_model: str | None = None, settings: Mapping[str, Any] | None = None) -> NaiveStrategy:
        """Index the chunks of ``config.levels`` (embedded through the build client's ``embedder``); the index's
        manifest records ``embedding_model`` (the served embedder's model), the levels and ``settings`` (the
        hierarchy's, under ``hierarchy``)."""
        indexed = cls._indexed(chunks, config, "naive.levels")
        return cls(build_index(config.index, indexed, embed=_embedder(client), embedding_model=embedding_model,
                               extra_settings={"levels": list(config.levels), "hierarchy": dict(settings or {})}),
                   config, answer)

    @staticmethod
    def _indexed(chunks: Sequence[Chunk], config: NaiveConfig, what: str) -> list[Chunk]:
        """The chunks at ``config.levels``; a ConfigError naming ``what`` when there is none."""
        indexed = [c for c in chunks if c.level in config.levels]  # levels checked by NaiveConfig
        if not indexed:
            raise ConfigError(f"{what}: no chunk at {', '.join(config.levels)}")
        return indexed

    def save_index(self, folder: Path) -> None:
        """The flat index and its manifest in ``folder`` (a part of a saved ``Retriever``)."""
        write_index_files(self.index, folder)

    @classmethod
    def load_index(cls, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: NaiveConfig, answer: AnswerConfig, *, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None) -> NaiveStrategy:
        """The strategy over the flat index ``save_index`` wrote (which keeps its own chunks: ``documents`` and
        ``chunks`` are not read), refused (``IndexMismatchError``) when it was built with another embedding model,
        hierarchy ``settings``, levels or index kind."""
        kind = json.loads((folder / "index.json").read_text()).get("kind")
        if kind != config.index:
            raise IndexMismatchError(f"{folder}: the saved naive index is {kind!r} but naive.index is "
                                     f"{config.index!r}")
        wanted = {"levels": list(config.levels), **({"hierarchy": dict(settings)} if settings is not None else {})}
        index = read_index_files(INDEX_CLASSES[kind], folder, folder, _embedder(client), embedding_model, wanted)
        return cls(index, config, answer)

    def with_documents(self, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                       replace: bool = False) -> NaiveStrategy:
        """This strategy over its index plus the chunks of ``documents`` at its levels (``chunks``: their hierarchy;
        only those embedded, through ``client``); with ``replace`` their old chunks go first. The index here is left
        as it was."""
        added = self._indexed(chunks, self.config, f"naive.levels (document(s) "
                                                   f"{', '.join(sorted({c.doc_id for c in chunks}))})")
        return NaiveStrategy(self.index.with_documents(added, _embedder(client), replace=replace), self.config,
                             self.answer_config)

    def without_documents(self, doc_ids: Iterable[str]) -> NaiveStrategy:
        """This strategy over its index without the chunks of ``doc_ids`` (a document with no chunk at the indexed
        levels has none to drop); the index here is left as it was."""
        present = {c.doc_id for c in self.index.chunks}
        dropped = [d for d in dict.fromkeys(doc_ids) if d in present]
        if not dropped:
            return self
        return NaiveStrategy(self.index.without_documents(dropped), self.config, self.answer_config)

    def max_evidence(self) -> int:
        """The most chunks one retrieval can return: the index's chunks (those at ``naive.levels``)."""
        return len(self.index.chunks)

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """The top ``k`` chunks (``naive.k`` when None; of the documents ``scope`` names, when given) with their
        index scores; the query embedding goes through ``client``."""
        try:
            hits = self.index.search([question], k or self.config.k,
                                     embed=lambda texts: client.embed("embedder", texts), doc_ids=scope)[0]
        except ClientError as exc:
            raise_if_refused(exc, "naive's query embedding (role 'embedder')")
            return Retrieval(failure="request_failed", failure_detail=str(exc))
        return Retrieval([h.chunk for h in hits], [h.score for h in hits])

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """The top-k chunks (of the documents ``scope`` names, when given) go to the generator."""
        found = self.retrieve_evidence(question, client, scope)
        if found.failure:
            return found.failed_answer()
        return found.scored(generate_answer(question, found.evidence, client, self.answer_config))


def _embedder(client: Client):
    """``client``'s ``embedder`` role as an index's embed function."""
    return lambda texts: client.embed("embedder", texts)
