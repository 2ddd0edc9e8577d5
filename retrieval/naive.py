"""The naive strategy: the top-k chunks of one flat index go to the generator. The baseline of every comparison.

It is ``overstory eval rag`` as a strategy of the evaluation harness: same index kinds, same answer prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, check_level
from overstory.retrieval.answer import AnswerConfig, generate_answer
from overstory.retrieval.index import IndexKind, build_index
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
    def build(cls, chunks: Sequence[Chunk], client: Client, config: NaiveConfig, answer: AnswerConfig
              ) -> NaiveStrategy:
        """Index the chunks of ``config.levels`` (embedded through the build client's ``embedder``)."""
        indexed = [c for c in chunks if c.level in config.levels]  # levels checked by NaiveConfig
        if not indexed:
            raise ConfigError(f"naive.levels: no chunk at {', '.join(config.levels)}")
        return cls(build_index(config.index, indexed, embed=lambda texts: client.embed("embedder", texts)),
                   config, answer)

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
