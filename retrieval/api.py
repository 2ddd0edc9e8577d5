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
scores are None, the answer is in ``details["prediction"]``). A ``k`` past what the index can return
(``Retriever.max_k``) is a ValueError naming both: naive's chunks at its levels, every chunk SmartChunk can plan over,
LATTICE's leaves, FABLE's leaf nodes, Orion-RAG's tagged chunks (each strategy's ``max_evidence``); for A-RAG and the
BM25 floor, the hierarchy's chunks.

Persistence (``PERSISTENT``: naive, SmartChunk, LATTICE, FABLE, Orion-RAG): ``Retriever.save`` writes the documents,
their hierarchy and the strategy's index (its ``save_index``) as a new version of a folder with a manifest (strategy,
corpus hash, the served embedder's model, the hierarchy / strategy / answer settings); ``Retriever.load`` reads it
back and refuses another embedding model or settings (``IndexMismatchError``). ``add_documents`` and
``remove_documents`` update in place through each strategy's ``with_documents`` / ``without_documents``
(docs/strategies.md, "Indexes that persist and update"); ``add_documents`` returns what the add cost (embedding calls,
the LLM calls of LATTICE, FABLE and Orion-RAG, and the replies that fell back: FABLE's chunk, group and summary
replies, Orion-RAG's master and paragraph tags). A SmartChunk index with ``upper: compressor`` records the served
compressor's model too, and a load refuses another.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError, build
from overstory.core.records import Chunk, Document, read_jsonl, write_jsonl
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.arag import ARagConfig, ARagStrategy
from overstory.retrieval.bm25_floor import BM25FloorStrategy
from overstory.retrieval.evidence import Answered, Cost, Evidence, Retrieved, evidence_list, usage_by_role
from overstory.retrieval.fable.strategy import FableConfig, FableStrategy
from overstory.retrieval.index import DocumentExistsError, UnknownDocumentError
from overstory.retrieval.index_manifest import (
    IndexMismatchError,
    check_contents,
    check_manifest,
    chunks_hash,
    read_manifest,
    read_versioned,
    save_versioned,
    write_manifest,
)
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
from overstory.serving.job_client import client_for

__all__ = [
    "STRATEGIES", "SECTIONS", "Models", "Retriever", "Evidence", "Cost", "Retrieved", "Answered", "build_strategy",
    "strategy_config", "check_strategies", "documents_from", "usage_by_role", "IndexMismatchError",
    "DocumentExistsError", "UnknownDocumentError", "PERSISTENT",
]

STRATEGIES = ("naive", "smartchunk", "lattice", "arag", "fable", "orion", "bm25_floor")
# each strategy's config section (the BM25 floor has none)
SECTIONS: dict[str, type] = {"naive": NaiveConfig, "smartchunk": SmartChunkConfig, "lattice": LatticeStrategyConfig,
                             "arag": ARagConfig, "fable": FableConfig, "orion": OrionConfig}
# strategies without a retrieval step of their own: ``retrieve`` runs their answer and returns what it read
READ_BY_ANSWERING = ("arag", "bm25_floor")
# strategies whose index ``Retriever.save`` / ``load`` persist and ``add_documents`` / ``remove_documents`` update
PERSISTENT_CLASSES: dict[str, Any] = {"naive": NaiveStrategy, "smartchunk": SmartChunkStrategy,
                                      "lattice": LatticeStrategy, "fable": FableStrategy, "orion": OrionStrategy}
PERSISTENT = tuple(PERSISTENT_CLASSES)
RETRIEVER_KIND = "retriever"  # the kind a saved Retriever's manifest names


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
                   config: Any = None, answer: AnswerConfig | Mapping | None = None, forest: str = "", *,
                   embedding_model: str | None = None, settings: Mapping[str, Any] | None = None,
                   compressor_model: str | None = None) -> Strategy:
    """Build strategy ``name`` over the corpus (``chunks``: the documents' hierarchy); index calls (embeddings,
    FABLE's summaries) go through ``client``. ``config`` is the strategy's section (see ``strategy_config``),
    ``answer`` how the generator is asked. FABLE reads a saved ``forest`` (a forest.json from ``overstory data
    fable-forest``) or builds one; Orion-RAG reads its tags folder (``orion.tags``, from ``overstory data
    orion-tags``); LATTICE its tree (``lattice.tree``, from ``overstory data lattice-tree``). The naive and SmartChunk
    indexes record ``embedding_model`` (the served embedder's model) and ``settings`` (the hierarchy's) for saves, and
    SmartChunk's with ``upper: compressor`` ``compressor_model`` (the served compressor's)."""
    section = strategy_config(name, config)
    asked = _section(AnswerConfig, answer, "answer")
    if name == "bm25_floor":
        return BM25FloorStrategy.build(chunks)
    if name == "naive":
        return NaiveStrategy.build(chunks, client, section, asked, embedding_model=embedding_model,
                                   settings=settings)
    if name == "smartchunk":
        return SmartChunkStrategy.build(documents, chunks, client, section, asked, embedding_model=embedding_model,
                                        settings=settings, compressor_model=compressor_model)
    if name == "arag":
        return ARagStrategy.build(chunks, client, section)
    recorded = {"embedding_model": embedding_model, "settings": settings}
    if name == "fable":
        if forest:
            return FableStrategy.load(forest, section, asked, **recorded)
        return FableStrategy.build(documents, chunks, client, config=section, answer=asked, **recorded)
    if name == "orion":
        return OrionStrategy.build(client, section, asked, **recorded)
    check_lattice_tree(section)
    tree = Tree.load(section.tree)
    leaf_ids = {node.id for node in tree.leaves()}
    return LatticeStrategy(tree, [c for c in chunks if c.level == section.leaf_level and c.id in leaf_ids], section,
                           asked, **recorded)


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
        self._served: dict[str, str | None] = {}  # role -> served model, from /v1/models

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

    def served_model(self, role: str) -> str | None:
        """The model behind ``role`` (the ``root`` of its entry in the servers' ``/v1/models``), asked once; None
        when no server lists it. What a saved index records as its embedding model."""
        if role not in self._served:
            entries = [m for response in self.client.backend.get("/v1/models") for m in response["data"]]
            self._served.update({m["id"]: m.get("root") or m["id"] for m in entries})
            self._served.setdefault(role, None)
        return self._served[role]

    def close(self) -> None:
        """Close the client, and stop the models this object started."""
        self._owned.close()

    def __enter__(self) -> Models:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ retriever


@dataclass(frozen=True)
class _Held:
    """What a ``Retriever`` holds, swapped as one value by an update: its strategy, documents and their hierarchy."""

    strategy: Strategy
    documents: dict[str, Document]
    chunks: tuple[Chunk, ...]


def hierarchy_settings(settings: Any) -> dict[str, Any]:
    """The hierarchy settings the chunks came from as a plain mapping: a dataclass (``HierarchyConfig``) or a
    mapping; {} for None."""
    if settings is None:
        return {}
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return dataclasses.asdict(settings)
    if isinstance(settings, Mapping):
        return dict(settings)
    raise ConfigError(f"settings: expected the hierarchy's settings (a HierarchyConfig or a mapping), got "
                      f"{type(settings).__name__}")


def check_hierarchy(documents: Sequence[Document], chunks: Sequence[Chunk], every_document: bool = True) -> None:
    """A ConfigError for a chunk of a document not among ``documents`` or (``every_document``) a document without
    chunks."""
    ids, owners = {d.id for d in documents}, {c.doc_id for c in chunks}
    if strays := sorted(owners - ids):
        raise ConfigError(f"chunks: document(s) {', '.join(strays[:3])} are not among the documents given")
    if every_document and (bare := sorted(ids - owners)):
        raise ConfigError(f"chunks: document(s) {', '.join(bare[:3])} have no chunk; give their hierarchy")


class Retriever:
    """One strategy built over a corpus, answering through ``models``; see the module docstring.

    ``save`` / ``load`` persist it and ``add_documents`` / ``remove_documents`` update it in place (strategies of
    ``PERSISTENT``). An update builds the new index beside the old one and swaps the pair (strategy, documents) in one
    assignment, so a ``retrieve`` running meanwhile in another thread reads the old or the new index, never a mix;
    updates themselves run one at a time.
    """

    def __init__(self, strategy: Strategy, name: str, models: Models, documents: Sequence[Document],
                 chunks: Sequence[Chunk], index_cost: Cost, config: Any = None, answer: AnswerConfig | None = None,
                 settings: Mapping[str, Any] | None = None):
        self.name, self.models, self.index_cost = name, models, index_cost
        self.config, self.answer_config = config, answer or AnswerConfig()
        self.settings = dict(settings or {})  # the hierarchy's, recorded by save and checked by load
        self._held = _Held(strategy, {d.id: d for d in documents}, tuple(chunks))
        self._update_lock = threading.Lock()

    strategy = property(lambda self: self._held.strategy, doc="The strategy built over the documents held now.")
    strategy_name = property(lambda self: self.name, doc="The strategy's name (one of ``STRATEGIES``).")
    doc_ids = property(lambda self: frozenset(self._held.documents), doc="The ids of the documents held now.")

    @classmethod
    def build(cls, strategy: str, documents: Sequence[Document | Mapping[str, Any]], chunks: Sequence[Chunk],
              models: Models, config: Any = None, answer: AnswerConfig | Mapping | None = None,
              forest: str = "", settings: Any = None) -> Retriever:
        """Build ``strategy`` over ``documents`` and their hierarchy ``chunks`` (``build_strategy``; its index cost
        is ``index_cost``). Chunks of a document not in ``documents`` are a ConfigError. ``settings`` are the
        hierarchy's (a ``HierarchyConfig`` or a mapping): a save records them and ``load`` can check them."""
        documents = documents_from(documents)
        check_hierarchy(documents, chunks, every_document=False)
        section, asked = strategy_config(strategy, config), _section(AnswerConfig, answer, "answer")
        recorded = hierarchy_settings(settings)
        embedding_model = models.served_model("embedder") if strategy in PERSISTENT else None
        client, started = models.client.fork(), time.perf_counter()
        built = build_strategy(strategy, documents, chunks, client, section, asked, forest,
                               embedding_model=embedding_model, settings=recorded,
                               compressor_model=_compressor_model(models, strategy, section))
        cost = Cost(usage_by_role(client), round(time.perf_counter() - started, 3), _fallbacks(built))
        return cls(built, strategy, models, documents, chunks, cost, section, asked, recorded)

    def _persistent(self, what: str) -> None:
        """A ConfigError unless this strategy's index persists and updates."""
        if self.name not in PERSISTENT:
            raise ConfigError(f"{self.name}: cannot {what} this strategy's index; the strategies that persist and "
                              f"update are {', '.join(PERSISTENT)}")

    def save(self, folder: str | Path) -> None:
        """Save as a new version of ``folder``, swapped in atomically (``index_manifest.save_versioned``): the
        documents, their hierarchy, the strategy's index, and a manifest naming the strategy, the corpus hash, the
        served embedder's model and the settings (the hierarchy's, the strategy's section, the answer's)."""
        self._persistent("save")
        held = self._held
        manifest = {"kind": RETRIEVER_KIND, "strategy": self.name, "corpus_hash": chunks_hash(held.chunks),
                    "n_chunks": len(held.chunks), "n_documents": len(held.documents),
                    "embedding_model": self.models.served_model("embedder"),
                    "settings": {"hierarchy": self.settings, "config": dataclasses.asdict(self.config),
                                 "answer": dataclasses.asdict(self.answer_config)}}

        def write(version: Path) -> None:
            version.mkdir(parents=True)
            write_jsonl(version / "documents.jsonl", held.documents.values())
            write_jsonl(version / "chunks.jsonl", held.chunks)
            held.strategy.save_index(version / "index")  # type: ignore[attr-defined]  # PERSISTENT strategies
            write_manifest(version, manifest)

        save_versioned(folder, write)

    @classmethod
    def load(cls, folder: str | Path, models: Models, config: Any = None, answer: AnswerConfig | Mapping | None = None,
             settings: Any = None) -> Retriever:
        """The retriever ``save`` wrote in ``folder``, answering through ``models``: its strategy, documents and
        index as saved, nothing embedded again. Refused (``IndexMismatchError``, naming what differs) when the
        folder was saved with another embedding model than ``models`` serve (or, for SmartChunk with ``upper:
        compressor``, another compressor), other hierarchy ``settings`` (when given), or an index that ``config``
        (the strategy's section; None: the saved one) cannot read, such as another index kind, levels or way of
        embedding."""
        embedding_model = models.served_model("embedder")

        def read(files: Path, versioned: bool) -> Retriever:
            manifest = read_manifest(files) if versioned else {}
            if manifest.get("kind") != RETRIEVER_KIND:
                raise IndexMismatchError(f"{folder}: no saved Retriever here (Retriever.save writes one)")
            wanted = {"hierarchy": hierarchy_settings(settings)} if settings is not None else {}
            check_manifest(manifest, folder, embedding_model, wanted)
            name, recorded = manifest["strategy"], manifest["settings"]
            section = strategy_config(name, recorded["config"] if config is None else config)
            asked = _section(AnswerConfig, recorded["answer"] if answer is None else answer, "answer")
            documents = list(read_jsonl(files / "documents.jsonl", Document))
            chunks = list(read_jsonl(files / "chunks.jsonl", Chunk))
            check_contents(manifest, folder, RETRIEVER_KIND, len(chunks), chunks_hash(chunks))
            strategy = load_strategy(name, files / "index", documents, chunks, models.client, section, asked,
                                     embedding_model, recorded["hierarchy"], _compressor_model(models, name, section))
            return cls(strategy, name, models, documents, chunks, Cost({}, 0.0), section, asked,
                       recorded["hierarchy"])

        return read_versioned(folder, read)

    def add_documents(self, documents: Sequence[Document | Mapping[str, Any]], chunks: Sequence[Chunk],
                      replace: bool = False) -> Cost:
        """Add ``documents`` (``chunks``: their hierarchy, e.g. ``build_hierarchies(documents, settings)``) to the
        index in place: only their chunks are embedded or indexed. A document already held is refused
        (``DocumentExistsError``) unless ``replace``, which drops its old chunks first. Returns what the add cost:
        the model calls by role (the embedder's; LATTICE's scorer, FABLE's and Orion-RAG's generator too), the
        seconds, and the replies that fell back (``Cost.fallbacks``)."""
        self._persistent("add documents to")
        documents, chunks = documents_from(documents), list(chunks)
        check_hierarchy(documents, chunks)
        with self._update_lock:
            held = self._held
            if (present := [d.id for d in documents if d.id in held.documents]) and not replace:
                raise DocumentExistsError(f"already in the index: document {', '.join(map(repr, present))}; remove "
                                          "it first or add with replace=True")
            client, started = self.models.client.fork(), time.perf_counter()
            strategy = held.strategy.with_documents(  # type: ignore[attr-defined]  # PERSISTENT strategies
                documents, chunks, client, replace)
            ids = {d.id for d in documents}
            kept = (c for c in held.chunks if c.doc_id not in ids)
            self._held = _Held(strategy, {**held.documents, **{d.id: d for d in documents}}, (*kept, *chunks))
        return Cost(usage_by_role(client), round(time.perf_counter() - started, 3), _fallbacks(strategy))

    def remove_documents(self, ids: Iterable[str]) -> None:
        """Remove the documents ``ids`` from the index in place: their chunks, vectors and terms, nothing else. An id
        not held is an ``UnknownDocumentError`` naming it; removing every document is a ValueError."""
        self._persistent("remove documents from")
        if isinstance(ids, str):
            raise TypeError(f"ids must be a list of document ids, not the string {ids!r}")
        wanted = list(dict.fromkeys(ids))
        with self._update_lock:
            held = self._held
            if unknown := [d for d in wanted if d not in held.documents]:
                raise UnknownDocumentError(f"not in the index: document {', '.join(map(repr, unknown))}")
            if not wanted or set(held.documents) <= set(wanted):
                raise ValueError("no document to remove" if not wanted else
                                 "removing every document would leave the index empty; build a new index instead")
            strategy = held.strategy.without_documents(wanted)  # type: ignore[attr-defined]  # PERSISTENT strategies
            dropped = set(wanted)
            self._held = _Held(strategy, {i: d for i, d in held.documents.items() if i not in dropped},
                               tuple(c for c in held.chunks if c.doc_id not in dropped))

    @property
    def max_k(self) -> int:
        """The most evidence chunks one ``retrieve`` can return from the index held now (``k`` past it is refused)."""
        return _max_k(self._held)

    @staticmethod
    def _scope(held: _Held, scope: str | Sequence[str] | None) -> list[str] | None:
        """``scope`` as a list of document ids (one id may be given alone); an id not in the corpus is a
        ValueError."""
        if scope is None:
            return None
        ids = [scope] if isinstance(scope, str) else list(scope)
        if not ids or (missing := [d for d in ids if d not in held.documents]):
            raise ValueError(f"scope: {', '.join(missing) if ids else 'no document'} is not a document of this corpus")
        return ids

    def retrieve(self, question: str, k: int | None = None, scope: str | Sequence[str] | None = None) -> Retrieved:
        """The evidence for ``question`` from the documents ``scope`` names (None: the whole corpus), at most ``k``
        chunks (None: the strategy's own setting), and its cost. An empty question, a ``k`` below 1 or past what the
        index can return (``max_k``) is a ValueError."""
        _check_question(question)
        held = self._held  # one snapshot: an update meanwhile swaps in a new one
        if k is not None:
            _check_k(k, self.name, _max_k(held))
        ids, client, started = self._scope(held, scope), self.models.client.fork(), time.perf_counter()
        if self.name in READ_BY_ANSWERING:
            answered = held.strategy.answer(question, client, ids)
            found = Retrieval(answered.evidence[:k] if k else answered.evidence, [], answered.failure,
                              answered.failure_detail, {**answered.details, "prediction": answered.prediction})
        else:
            retriever: RetrievingStrategy = held.strategy  # type: ignore[assignment]  # every other strategy
            found = retriever.retrieve_evidence(question, client, ids, k)
        cost = Cost(usage_by_role(client), round(time.perf_counter() - started, 3))
        return Retrieved(evidence_list(found.evidence, found.scores), cost, found.failure, found.failure_detail,
                         found.details)

    def answer(self, question: str, scope: str | Sequence[str] | None = None) -> Answered:
        """The generator's answer to ``question`` from what the strategy retrieved in ``scope``'s documents (None:
        the whole corpus), with that evidence and the cost."""
        _check_question(question)
        held = self._held
        ids, client, started = self._scope(held, scope), self.models.client.fork(), time.perf_counter()
        result: StrategyAnswer = held.strategy.answer(question, client, ids)
        cost = Cost(usage_by_role(client), round(time.perf_counter() - started, 3))
        return Answered(result.prediction, result.raw, evidence_list(result.evidence, result.scores), cost,
                        result.failure, result.failure_detail, result.details)


def load_strategy(name: str, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                  config: Any, answer: AnswerConfig, embedding_model: str | None, settings: Mapping[str, Any],
                  compressor_model: str | None = None) -> Strategy:
    """The strategy ``name`` over the index its ``save_index`` wrote in ``folder``, for ``documents`` and their
    hierarchy ``chunks`` (each checks its own manifest against ``embedding_model``, ``settings`` and ``config``;
    SmartChunk against ``compressor_model`` too, the served compressor's)."""
    if name not in PERSISTENT_CLASSES:
        raise ConfigError(f"{name}: no saved index of this strategy can be read; the strategies that persist are "
                          f"{', '.join(PERSISTENT)}")
    served = {"compressor_model": compressor_model} if name == "smartchunk" else {}
    return PERSISTENT_CLASSES[name].load_index(folder, documents, chunks, client, config, answer,
                                               embedding_model=embedding_model, settings=settings, **served)


def _compressor_model(models: Models, name: str, section: Any) -> str | None:
    """The served compressor's model where strategy ``name`` embeds with it (SmartChunk with ``upper: compressor``),
    for its index to record and check; else None (asking ``/v1/models`` only then)."""
    if name == "smartchunk" and section.upper == "compressor":
        return models.served_model("compressor")
    return None


def _fallbacks(strategy: Strategy) -> dict[str, int]:
    """The replies that fell back while ``strategy``'s index was made (FABLE's trees, Orion-RAG's tags of added
    documents: their ``fallbacks``); {} for the strategies that ask a model for no part of their index."""
    return dict(getattr(strategy, "fallbacks", {}))


def _max_k(held: _Held) -> int:
    """The most evidence chunks one retrieval from ``held`` can return: the strategy's ``max_evidence`` (see the
    module docstring); for the strategies that retrieve by answering, the chunks of the hierarchy they read."""
    if hasattr(held.strategy, "max_evidence"):
        return held.strategy.max_evidence()  # naive, SmartChunk, LATTICE, FABLE, Orion-RAG
    return len(held.chunks)


def _check_k(k: Any, name: str, bound: int) -> None:
    """A ValueError unless ``k`` is an integer from 1 to ``bound`` (what the ``name`` index can return)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer of at least 1, got {k!r}")
    if k > bound:
        raise ValueError(f"k={k} is more than the {name} index can return: at most {bound} chunks")


def _check_question(question: Any) -> None:
    """A ValueError unless ``question`` is a non-empty string."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
