"""The Python API: evidence, and answers, for one's own questions from one's own program (docs/api.md).

    from overstory.retrieval.api import Models, Retriever, documents_from

A ``Retriever`` is one strategy (naive, SmartChunk, LATTICE, A-RAG, FABLE, Orion-RAG, the BM25 floor) built over a
corpus, its documents and their hierarchy (``overstory.data_pipeline.hierarchy.build_hierarchies``), calling the
models of a ``Models``: a running stack's URL (``Models.from_url``), the built-in models loaded in this process
(``Models.builtin``), or a stack started in the background (``Models.start``). ``retrieve`` gives a question's
evidence chunks (id, document, text, level, score) and what it cost; ``answer`` adds the generator's answer.

``build_strategy`` is the one place strategies are built: the evaluation harness (``overstory eval pipeline``)
calls it too, with the same config sections (``NaiveConfig``, ``SmartChunkConfig``, ...), so what a program calls
is what the suite evaluates. A section may be given as that dataclass or as a mapping, checked as the harness
checks its YAML: a misspelt key is a ``ConfigError`` naming it (``unknown config key 'naive.kk'; did you mean
'naive.k'?``), as is an unknown strategy.

Costs come from the servers' ``usage``, per call of ``retrieve`` or ``answer`` on a client of its own
(``Client.fork``): requests, prompt and completion tokens and failed requests by role, and the seconds taken.

What ``retrieve`` returns per strategy: naive and SmartChunk search ``k`` deep (their config's ``k`` when not
given; SmartChunk's planner call is part of retrieving), LATTICE, FABLE and Orion-RAG return their ranking cut to
``k``. A-RAG is an agent whose reading and answering interleave, and the BM25 floor answers with the sentence it
retrieves: for them ``retrieve`` runs ``answer`` and returns the chunks it read (the cost includes the answer;
scores are None, the answer is in ``details["prediction"]``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from overstory.core.config import ConfigError, build
from overstory.core.records import Chunk, Document
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.arag import ARagConfig, ARagStrategy
from overstory.retrieval.bm25_floor import BM25FloorStrategy
from overstory.retrieval.fable.strategy import FableConfig, FableStrategy
from overstory.retrieval.lattice.strategy import LatticeStrategy, LatticeStrategyConfig
from overstory.retrieval.lattice.tree import Tree
from overstory.retrieval.naive import NaiveConfig, NaiveStrategy
from overstory.retrieval.orion.strategy import OrionConfig, OrionStrategy
from overstory.retrieval.smartchunk import SmartChunkConfig, SmartChunkStrategy
from overstory.retrieval.strategy import Retrieval, RetrievingStrategy, Strategy, StrategyAnswer
from overstory.serving.client import Client
from overstory.serving.config import ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.in_process import in_process_client
from overstory.serving.launch import client_for

__all__ = [
    "STRATEGIES", "SECTIONS", "Models", "Retriever", "Evidence", "Cost", "Retrieved", "Answered", "build_strategy",
    "strategy_config", "check_strategies", "documents_from", "usage_by_role",
]

STRATEGIES = ("naive", "smartchunk", "lattice", "arag", "fable", "orion", "bm25_floor")
# each strategy's config section (the BM25 floor has none)
SECTIONS: dict[str, type] = {"naive": NaiveConfig, "smartchunk": SmartChunkConfig, "lattice": LatticeStrategyConfig,
                             "arag": ARagConfig, "fable": FableConfig, "orion": OrionConfig}
# strategies without a retrieval step of their own: ``retrieve`` runs their answer and returns what it read
READ_BY_ANSWERING = ("arag", "bm25_floor")


# ------------------------------------------------------------------------------------------------ settings


def check_strategies(names: Sequence[str]) -> None:
    """A ConfigError naming the strategies that are not ones of ``STRATEGIES`` (or that none was given)."""
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise ConfigError(f"strategies: {', '.join(unknown) or 'none given'}; choose from {', '.join(STRATEGIES)}")


def check_lattice_tree(config: LatticeStrategyConfig) -> None:
    """LATTICE searches a tree built beforehand: a ConfigError when ``lattice.tree`` names none."""
    if not config.tree:
        raise ConfigError("lattice.tree: the lattice strategy needs a tree from `overstory data lattice-tree` over "
                          "the same corpus")


def _section(cls: type, value: Any, key: str) -> Any:
    """``value`` as a ``cls`` config: the dataclass itself, a mapping checked key by key (a misspelt key is a
    ConfigError naming ``key``.<it>), or None for the defaults."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        return build(cls, dict(value), prefix=f"{key}.")
    raise ConfigError(f"{key}: expected a {cls.__name__} or a mapping, got {type(value).__name__}")


def strategy_config(name: str, section: Any = None) -> Any:
    """The config section of strategy ``name``: ``section`` (its dataclass or a mapping of its keys) checked, or the
    defaults when None; None for the BM25 floor, which has no settings. An unknown name is a ConfigError."""
    check_strategies([name])
    if name not in SECTIONS:
        if section:
            raise ConfigError(f"{name}: this strategy has no settings, got {section!r}")
        return None
    return _section(SECTIONS[name], section, name)


def build_strategy(name: str, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: Any = None, answer: AnswerConfig | Mapping | None = None, forest: str = "") -> Strategy:
    """Build strategy ``name`` over the corpus (``chunks``: the documents' hierarchy); index calls (embeddings,
    FABLE's summaries) go through ``client``. ``config`` is the strategy's section (see ``strategy_config``),
    ``answer`` how the generator is asked. FABLE reads a saved ``forest`` (a forest.json from ``overstory data
    fable-forest``) or builds one; Orion-RAG reads its tags folder (``orion.tags``, from ``overstory data
    orion-tags``); LATTICE its tree (``lattice.tree``, from ``overstory data lattice-tree``)."""
    section = strategy_config(name, config)
    asked = _section(AnswerConfig, answer, "answer")
    if name == "bm25_floor":
        return BM25FloorStrategy.build(chunks)
    if name == "naive":
        return NaiveStrategy.build(chunks, client, section, asked)
    if name == "smartchunk":
        return SmartChunkStrategy.build(documents, chunks, client, section, asked)
    if name == "arag":
        return ARagStrategy.build(chunks, client, section)
    if name == "fable":
        if forest:
            return FableStrategy.load(forest, section, asked)
        return FableStrategy.build(documents, chunks, client, config=section, answer=asked)
    if name == "orion":
        return OrionStrategy.build(client, section, asked)
    check_lattice_tree(section)
    tree = Tree.load(section.tree)
    leaf_ids = {node.id for node in tree.leaves()}
    return LatticeStrategy(tree, [c for c in chunks if c.level == section.leaf_level and c.id in leaf_ids], section,
                           asked)


def documents_from(items: Iterable[Document | Mapping[str, Any]]) -> list[Document]:
    """Documents from ``Document``s or plain ``{"id", "title", "text"}`` mappings (``metadata`` optional); a missing
    or unknown field, an empty id or text, or a repeated id is a ConfigError naming the item."""
    documents: list[Document] = []
    for i, item in enumerate(items):
        if not isinstance(item, Document):
            if not isinstance(item, Mapping):
                raise ConfigError(f"documents[{i}]: expected a Document or a mapping, got {type(item).__name__}")
            fields = {"id", "title", "text", "metadata"}
            if missing := [key for key in ("id", "title", "text") if key not in item]:
                raise ConfigError(f"documents[{i}]: missing field(s) {', '.join(missing)} (give id, title, text)")
            if unknown := [key for key in item if key not in fields]:
                raise ConfigError(f"documents[{i}]: unknown field(s) {', '.join(map(str, unknown))} (id, title, "
                                  "text, metadata)")
            item = Document(str(item["id"]), str(item["title"]), str(item["text"]), dict(item.get("metadata", {})))
        if not item.id or not item.text.strip():
            raise ConfigError(f"documents[{i}]: id and text must not be empty")
        documents.append(item)
    ids = [d.id for d in documents]
    if repeated := sorted({i for i in ids if ids.count(i) > 1}):
        raise ConfigError(f"documents: repeated id(s) {', '.join(repeated)}")
    return documents


# ------------------------------------------------------------------------------------------------ models


class Models:
    """The served models a retriever calls, through one client, and what this object started for them (closed by
    ``close`` or at the end of a ``with`` block; a stack it only connected to keeps running)."""

    def __init__(self, client: Client, owned: ExitStack | None = None):
        self.client = client
        self._owned = owned or ExitStack()

    @classmethod
    def from_url(cls, url: str | Mapping[str, str], **http_options: Any) -> Models:
        """A running stack (``overstory serve``): its URL, a role -> URL mapping, or the stack.json of a vLLM stack;
        ``http_options`` go to ``Client.from_url`` (``timeout_s``, ``max_retries``)."""
        client = Client.from_url(url, **http_options)
        owned = ExitStack()
        owned.callback(client.close)
        return cls(client, owned)

    @classmethod
    def builtin(cls, serve: ServeConfig | None = None) -> Models:
        """The models of ``serve`` (default: the built-in SmolLM2-135M-Instruct for the chat roles and MiniLM
        embeddings, ``ServeConfig.local``) loaded in this process and called through the server's own handlers
        (no socket); freed by ``close``."""
        owned = ExitStack()
        engine = owned.enter_context(EmbeddedEngine(serve or ServeConfig.local(port=0)))
        return cls(in_process_client(engine), owned)

    @classmethod
    def start(cls, serve: ServeConfig) -> Models:
        """``overstory serve`` with ``serve``'s settings (embedded or vLLM) started in the background, as the jobs
        start their stack; stopped by ``close``."""
        owned = ExitStack()
        client = owned.enter_context(client_for(serve))
        return cls(client, owned)

    def close(self) -> None:
        """Close the client, and stop the models this object started."""
        self._owned.close()

    def __enter__(self) -> Models:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Evidence:
    """One evidence chunk: a node of its document's hierarchy, and the strategy's score for it (None where the
    strategy ranks without scores)."""

    id: str
    doc_id: str
    text: str
    level: str
    score: float | None
    title: str = ""
    start: int = 0  # the chunk's span in its document's text
    end: int = 0

    @classmethod
    def of(cls, chunk: Chunk, score: float | None) -> Evidence:
        return cls(chunk.id, chunk.doc_id, chunk.text, chunk.level, None if score is None else float(score),
                   chunk.title, chunk.start, chunk.end)


def usage_by_role(client: Client) -> dict[str, dict[str, int]]:
    """What ``client`` spent, by role: requests (``calls``), prompt and completion tokens, failed requests."""
    return {role: {"calls": s["requests"], "prompt_tokens": s["prompt_tokens"],
                   "completion_tokens": s["completion_tokens"], "failed_calls": s["failures"]}
            for role, s in client.stats.summary().items()}


@dataclass(frozen=True)
class Cost:
    """What one call spent: per role, ``calls``, ``prompt_tokens``, ``completion_tokens`` and ``failed_calls`` (the
    servers' usage), and the seconds it took."""

    roles: dict[str, dict[str, int]]
    seconds: float

    @property
    def calls(self) -> int:
        """Requests over every role (the embedder's included)."""
        return sum(role["calls"] for role in self.roles.values())

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens over every role."""
        return sum(role["prompt_tokens"] + role["completion_tokens"] for role in self.roles.values())


@dataclass(frozen=True)
class Retrieved:
    """A question's evidence, best first, and its cost; ``failure`` is "" unless the retrieval failed (a request
    that failed after the client's retries: ``request_failed``, with the error in ``failure_detail``)."""

    evidence: list[Evidence]
    cost: Cost
    failure: str = ""
    failure_detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # what the strategy did: plan, sub-queries, slates...


@dataclass(frozen=True)
class Answered:
    """The generator's answer (``text``: cleaned; ``raw``: its reply), the evidence it was given and the cost."""

    text: str
    raw: str
    evidence: list[Evidence]
    cost: Cost
    failure: str = ""
    failure_detail: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def _evidence(chunks: Sequence[Chunk], scores: Sequence[float | None]) -> list[Evidence]:
    """Chunks with their scores (None past the end of ``scores``)."""
    return [Evidence.of(chunk, scores[i] if i < len(scores) else None) for i, chunk in enumerate(chunks)]


# ------------------------------------------------------------------------------------------------ retriever


class Retriever:
    """One strategy built over a corpus, answering through ``models``; see the module docstring."""

    def __init__(self, strategy: Strategy, name: str, models: Models, doc_ids: Iterable[str], index_cost: Cost):
        self.strategy, self.name, self.models, self.index_cost = strategy, name, models, index_cost
        self.doc_ids = frozenset(doc_ids)

    @classmethod
    def build(cls, strategy: str, documents: Sequence[Document | Mapping[str, Any]], chunks: Sequence[Chunk],
              models: Models, config: Any = None, answer: AnswerConfig | Mapping | None = None,
              forest: str = "") -> Retriever:
        """Build ``strategy`` over ``documents`` and their hierarchy ``chunks`` (``build_strategy``; its index cost
        is ``index_cost``). Chunks of a document not in ``documents`` are a ConfigError."""
        documents = documents_from(documents)
        ids = {d.id for d in documents}
        if strays := sorted({c.doc_id for c in chunks} - ids):
            raise ConfigError(f"chunks: document(s) {', '.join(strays[:3])} are not among the documents given")
        client, started = models.client.fork(), time.perf_counter()
        built = build_strategy(strategy, documents, chunks, client, config, answer, forest)
        return cls(built, strategy, models, ids, Cost(usage_by_role(client), round(time.perf_counter() - started, 3)))

    def _scope(self, scope: str | Sequence[str] | None) -> list[str] | None:
        """``scope`` as a list of document ids (one id may be given alone); an id not in the corpus is a
        ValueError."""
        if scope is None:
            return None
        ids = [scope] if isinstance(scope, str) else list(scope)
        if not ids or (missing := [d for d in ids if d not in self.doc_ids]):
            raise ValueError(f"scope: {', '.join(missing) if ids else 'no document'} is not a document of this corpus")
        return ids

    def retrieve(self, question: str, k: int | None = None, scope: str | Sequence[str] | None = None) -> Retrieved:
        """The evidence for ``question`` from the documents ``scope`` names (None: the whole corpus), at most ``k``
        chunks (None: the strategy's own setting), and its cost."""
        _check_question(question)
        if k is not None and k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        ids, client, started = self._scope(scope), self.models.client.fork(), time.perf_counter()
        if self.name in READ_BY_ANSWERING:
            answered = self.strategy.answer(question, client, ids)
            found = Retrieval(answered.evidence[:k] if k else answered.evidence, [], answered.failure,
                              answered.failure_detail, {**answered.details, "prediction": answered.prediction})
        else:
            retriever: RetrievingStrategy = self.strategy  # type: ignore[assignment]  # every other strategy
            found = retriever.retrieve_evidence(question, client, ids, k)
        cost = Cost(usage_by_role(client), round(time.perf_counter() - started, 3))
        return Retrieved(_evidence(found.evidence, found.scores), cost, found.failure, found.failure_detail,
                         found.details)

    def answer(self, question: str, scope: str | Sequence[str] | None = None) -> Answered:
        """The generator's answer to ``question`` from what the strategy retrieved in ``scope``'s documents (None:
        the whole corpus), with that evidence and the cost."""
        _check_question(question)
        ids, client, started = self._scope(scope), self.models.client.fork(), time.perf_counter()
        result: StrategyAnswer = self.strategy.answer(question, client, ids)
        cost = Cost(usage_by_role(client), round(time.perf_counter() - started, 3))
        return Answered(result.prediction, result.raw, _evidence(result.evidence, result.scores), cost,
                        result.failure, result.failure_detail, result.details)


def _check_question(question: Any) -> None:
    """A ValueError unless ``question`` is a non-empty string."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
