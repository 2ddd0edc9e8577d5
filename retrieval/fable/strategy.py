"""FABLE's online side: ``FableStrategy.answer`` runs the paper's Algorithm 1 over a forest (``forest``, built by
``builder``):

- Document level, bi-path: the model picks from a numbered list of the non-leaf nodes of depth <= L (root and,
  at L = 2, sections: title path and summary) -> the documents of the ids it names (ids out of range are dropped and
  counted); and vector top-K over every node of the forest, aggregated to documents by their best node. Fused:
  the LLM's documents first, then the vector path's, deduplicated.
- If the fused documents fit the budget B_max (tokens) they are returned whole. Otherwise, node level, bi-path:
  the model navigates the non-leaf nodes of those documents (same list and reply shape), and TreeExpansion scores
  every node of them (``tree_expansion_scores``) and takes nodes greedily by score within B_max
  (``greedy_select``). NodeFusion (``node_fusion``) drops the nodes whose ancestor is kept and orders the rest by
  document (the fused order: LLM-chosen documents first), then by position in the document. Budget control keeps
  the longest prefix of that order within B_max (``budget_prefix``).
- The generator answers from the returned nodes with the shared answer prompt (``generate_answer``), every node
  read whole (the budget, not the answer config's chunk count, bounds the context). A question longer than
  ``max_question_chars`` is cut for the embedding and every prompt (``question_truncated`` in the details).

A question with a document scope (QASPER's paper) is retrieved from those documents' trees only: the vector path
scores their nodes alone, so both paths, TreeExpansion and the budget see nothing else.

Deviation from the paper: its questions come with their own small document set; here the forest covers a whole
corpus (hundreds of documents), which no small generator can read in one prompt. The document-level LLM path is
therefore shown the ``llm_candidates`` documents the vector path ranks highest (in corpus order, so the ranking
is not leaked by position); with a per-question corpus of at most that many documents it sees them all, as in the
paper. Selection prompts list at most ``llm_max_nodes`` nodes.

Budget when nothing fits (B_max below the first document, or below every node the paths would return): the best
candidate (the first document; at node level the LLM's first pick, else the best TreeExpansion score) is cut to
B_max tokens, at its own characters per token with exact offsets, rather than leaving an empty context: the
generator reads the best evidence there is and ``budget_truncations`` says it happened. At node level an LLM pick
larger than B_max is otherwise left out (``oversized_selections``). B_max <= 0 is a config error.

Configs: the forest is built by ``configs/data/fable_forest.yaml``; the strategy runs in the evaluation harness.

Updates (``with_documents`` / ``without_documents``, which ``Retriever`` swaps in): a document's tree is built (with
the forest's own ``ForestConfig``, kept in its meta) and added, or dropped; every other tree, and every other node's
embedding, is kept as it was; the chunk, group and summary replies that fell back while the new trees were built are
counted in the new strategy's ``fallbacks``. ``save_index`` writes the forest with a manifest; ``load_index`` reads it
back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError, build
from overstory.core.records import Chunk, Document
from overstory.retrieval.answer import AnswerConfig, generate_answer
from overstory.retrieval.fable.builder import ForestBuilder, ForestConfig, fallback_counts
from overstory.retrieval.fable.forest import Forest, ForestNode
from overstory.retrieval.fable.paths import (
    budget_prefix,
    fuse_documents,
    greedy_select,
    node_fusion,
    tree_expansion_scores,
    vector_documents,
)
from overstory.retrieval.fable.replies import numbered, parse_ids
from overstory.retrieval.index_manifest import (
    check_contents,
    check_manifest,
    chunks_hash,
    read_manifest,
    write_manifest,
)
from overstory.retrieval.strategy import Retrieval, StrategyAnswer, raise_if_refused
from overstory.serving.client import Client, ClientError

# The paper's Table 1 variants, and "fable" for the full adaptive algorithm:
#   llm-docs: documents the LLM selects, returned whole;      docs: document-level bi-path, returned whole;
#   llm-nodes / treexp-nodes / nodes: document-level bi-path, then node level by LLM navigation only, TreeExpansion
#   only, or both, whatever the documents' size;              fable: whole documents when they fit B_max, else nodes.
MODES = ("fable", "llm-docs", "docs", "llm-nodes", "treexp-nodes", "nodes")
FABLE_KIND, FOREST_FILE = "fable", "forest.json"  # a saved FABLE index: its manifest's kind, its forest's file
DOCUMENT_MODES = ("llm-docs", "docs")


@dataclass(frozen=True)
class FableConfig:
    """How FABLE retrieves. The paper leaves L, K and B_max open (B_max from 1K to 128K tokens, 8K generator input
    in its headline results); these defaults suit the built-in SmolLM2-135M generator."""

    mode: str = "fable"  # one of MODES
    # B_max: the paper's smallest budget. SmolLM2-135M has an 8K context, but its answers degrade long before that
    # and a CPU prefill grows with every token; 1K tokens hold 6-8 HotpotQA paragraphs or 2-3 QASPER sections.
    budget_tokens: int = 1024
    # L: the root and its sections tell what a document covers; deeper levels (QASPER's subsections) triple the
    # list the LLM reads at the document level, past what the 135M model follows in one prompt.
    llm_depth: int = 2
    # K: nodes (not documents) from the vector path; several nodes of one document count once, so 10 nodes give a
    # handful of documents, about what fits B_max whole.
    top_k: int = 10
    llm_candidates: int = 10  # documents the document-level LLM path is shown (the vector path's best; see above)
    llm_max_nodes: int = 40  # lines of one selection prompt (titles and summaries): about 2K tokens
    llm_max_selected: int = 4  # ids one selection reply may name
    max_summary_chars: int = 200  # each node's summary is cut to this in selection prompts
    max_tokens: int = 48  # reply tokens of a selection call
    max_question_chars: int = 2000  # a longer question is cut (every prompt must fit the generator's context)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"fable.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for key in ("budget_tokens", "llm_depth", "top_k", "llm_candidates", "llm_max_nodes", "llm_max_selected",
                    "max_summary_chars", "max_tokens", "max_question_chars"):
            if getattr(self, key) < 1:
                raise ConfigError(f"fable.{key} must be at least 1, got {getattr(self, key)}")


def _without(forest: Forest, dropped: set[str]) -> tuple[list[Document], list[ForestNode]]:
    """The documents and nodes of ``forest`` outside the documents ``dropped``, in forest order."""
    return ([d for i, d in forest.documents.items() if i not in dropped],
            [n for n in forest.nodes.values() if n.doc_id not in dropped])


# ---------------------------------------------------------------------------------------- prompts and schemas

SELECT_PROMPT = """Question: {question}

Below is the table of contents of {what}: numbered titles with summaries. Choose the lines most likely to hold the \
answer.

{items}

Reply with JSON: {{"ids": [the numbers of at most {k} lines]}}."""


def selection_response_format(n: int, max_items: int) -> dict:
    """``{"ids": [line numbers]}``: 1 to ``max_items`` of 0..n-1 (a constrained decoder cannot invent an id; an
    unconstrained server may, and those are dropped and counted)."""
    schema = {"type": "object", "required": ["ids"], "properties": {"ids": {
        "type": "array", "minItems": 1, "maxItems": max_items,
        "items": {"type": "integer", "minimum": 0, "maximum": n - 1}}}}
    return {"type": "json_schema", "json_schema": {"name": "selection", "schema": schema}}


# ------------------------------------------------------------------------------------------------- strategy


# the problems counted for every question (the harness sums names ending in _unparsed or _failures)
PROBLEMS = ("documents_selection_unparsed", "documents_selection_id_failures", "nodes_selection_unparsed",
            "nodes_selection_id_failures", "request_failures")


@dataclass
class _Question:
    """One question's retrieval so far: the problem counts the harness sums, and the raw replies behind them."""

    counts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(PROBLEMS, 0)))
    unparsed: list[dict[str, str]] = field(default_factory=list)


class FableStrategy:
    """FABLE over a forest: ``build`` makes one with the generator and embedder, ``load`` reads a saved one."""

    def __init__(self, forest: Forest, config: FableConfig | None = None, answer: AnswerConfig | None = None, *,
                 embedding_model: str | None = None, settings: Mapping[str, Any] | None = None):
        if not forest.documents:
            raise ConfigError("fable: the forest has no documents")
        self.forest, self.config, self.answer_config = forest, config or FableConfig(), answer or AnswerConfig()
        self.name = "fable" if self.config.mode == "fable" else f"fable-{self.config.mode}"
        # what a save records: the served embedder's model (the nodes' vectors) and the hierarchy's settings
        self.embedding_model, self.settings = embedding_model, dict(settings or {})
        # the replies that fell back while this object built trees (build, with_documents), by kind; {} for none built
        self.fallbacks: dict[str, int] = {}

    @classmethod
    def build(cls, documents: Sequence[Document], hierarchy: Sequence[Chunk], client: Client,
              forest: ForestConfig | None = None, config: FableConfig | None = None,
              answer: AnswerConfig | None = None, *, embedding_model: str | None = None,
              settings: Mapping[str, Any] | None = None) -> FableStrategy:
        """Build every document's tree through ``client`` (``hierarchy``: ``build_hierarchies(documents, ...)``); a
        save records ``embedding_model`` (the served embedder's model) and ``settings`` (the hierarchy's)."""
        builder = ForestBuilder(client, forest)
        trees = [builder.build(document, hierarchy) for document in documents]
        built = cls(Forest.from_records([t.record() for t in trees], {"forest": asdict(builder.config)}), config,
                    answer, embedding_model=embedding_model, settings=settings)
        built.fallbacks = fallback_counts(trees)
        return built

    @classmethod
    def load(cls, forest_path: str | Path, config: FableConfig | None = None, answer: AnswerConfig | None = None, *,
             embedding_model: str | None = None, settings: Mapping[str, Any] | None = None) -> FableStrategy:
        """The strategy over a forest saved by ``overstory data fable-forest`` (``<out>/forest.json``); a save
        records ``embedding_model`` and ``settings`` as ``build``'s do."""
        return cls(Forest.load(forest_path), config, answer, embedding_model=embedding_model, settings=settings)

    # ---- persistence and updates

    def _derive(self, forest: Forest) -> FableStrategy:
        return FableStrategy(forest, self.config, self.answer_config, embedding_model=self.embedding_model,
                             settings=self.settings)

    def _chunks(self) -> list[Chunk]:
        """Every node of the forest as a chunk: what the manifest's corpus hash covers."""
        return [self.forest.chunk(node_id) for node_id in self.forest.ids]

    def save_index(self, folder: Path) -> None:
        """The forest (``forest.json``) and a manifest (the nodes' corpus hash, the embedding model, the forest's
        and the hierarchy's settings) in ``folder``: a part of a saved ``Retriever``."""
        folder.mkdir(parents=True, exist_ok=True)
        self.forest.save(folder / FOREST_FILE)
        chunks = self._chunks()
        write_manifest(folder, {"kind": FABLE_KIND, "corpus_hash": chunks_hash(chunks), "n_chunks": len(chunks),
                                "n_documents": len(self.forest.documents), "embedding_model": self.embedding_model,
                                "settings": {"forest": self.forest.meta.get("forest"), "hierarchy": self.settings}})

    @classmethod
    def load_index(cls, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: FableConfig, answer: AnswerConfig, *, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None) -> FableStrategy:
        """The strategy over the forest ``save_index`` wrote (it keeps its documents' text: ``documents`` and
        ``chunks`` are not read), refused (``IndexMismatchError``) for another embedding model or hierarchy settings,
        or nodes that differ from those saved."""
        manifest = read_manifest(folder)
        check_manifest(manifest, folder, embedding_model, {"hierarchy": dict(settings)} if settings is not None else {})
        strategy = cls(Forest.load(folder / FOREST_FILE), config, answer,
                       embedding_model=manifest.get("embedding_model"), settings=manifest["settings"]["hierarchy"])
        saved = strategy._chunks()
        check_contents(manifest, folder, FABLE_KIND, len(saved), chunks_hash(saved))
        return strategy

    def with_documents(self, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                       replace: bool = False) -> FableStrategy:
        """A strategy over the forest plus the trees of ``documents`` (``chunks``: their hierarchy), built through
        ``client`` with the forest's ``ForestConfig`` (the replies that fell back in its ``fallbacks``); with
        ``replace``, their old trees go first. Every other tree is kept as it was, and this strategy too."""
        recorded = self.forest.meta.get("forest")
        builder = ForestBuilder(client, build(ForestConfig, dict(recorded), prefix="forest.") if recorded else None)
        trees = [builder.build(document, chunks) for document in documents]
        kept, nodes = _without(self.forest, {d.id for d in documents} if replace else set())
        derived = self._derive(Forest([*kept, *(t.document for t in trees)],
                                      [*nodes, *(n for t in trees for n in t.nodes)], self.forest.meta))
        derived.fallbacks = fallback_counts(trees)
        return derived

    def without_documents(self, doc_ids: Iterable[str]) -> FableStrategy:
        """A strategy over the forest without the trees of ``doc_ids``; every other tree is kept as it was, and this
        strategy too."""
        return self._derive(Forest(*_without(self.forest, set(doc_ids)), self.forest.meta))

    def max_evidence(self) -> int:
        """The most nodes one retrieval can return: the forest's leaves (NodeFusion never returns a node with its
        ancestor, and documents are returned as their roots)."""
        return sum(1 for node in self.forest.nodes.values() if node.kind == "leaf")

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Retrieve (``retrieve_evidence``) and answer from the returned nodes; never raises for a bad reply or a
        transient request failure (a selection call the server refuses raises ``RequestRefused``; a scope naming a
        document the forest lacks raises ConfigError)."""
        found = self.retrieve_evidence(question, client, scope)
        if found.failure:
            return found.failed_answer()
        evidence = found.evidence
        read = AnswerConfig(max_tokens=self.answer_config.max_tokens, context_chunks=len(evidence),
                            max_chunk_chars=max((len(c.text) for c in evidence), default=1))
        asked = question[: self.config.max_question_chars]
        return found.scored(generate_answer(asked, evidence, client, read, **found.details))

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """Algorithm 1 (``retrieve``; from ``scope``'s documents only, when given): the nodes to read in reading
        order (the first ``k``, when given), without scores (FABLE orders them, it does not score them). A failed
        query embedding is the question's ``request_failed``."""
        asked = question[: self.config.max_question_chars]
        if scope is not None and (missing := [d for d in scope if d not in self.forest.documents]):
            raise ConfigError(f"fable_forest has no tree of {', '.join(missing)}: build it over the corpus evaluated")
        try:
            evidence, details = self.retrieve(asked, client, scope)
        except ClientError as exc:  # the question could not be embedded: there is nothing to retrieve with
            raise_if_refused(exc, "FABLE's query embedding (role 'embedder')")
            return Retrieval(failure="request_failed", failure_detail=str(exc),
                             details={"mode": self.config.mode, "request_failures": 1})
        details["question_truncated"] = len(asked) < len(question)
        evidence = evidence[:k] if k else evidence
        return Retrieval(evidence, [None] * len(evidence), details=details)

    def retrieve(self, question: str, client: Client, scope: Sequence[str] | None = None
                 ) -> tuple[list[Chunk], dict[str, Any]]:
        """The nodes to read, in reading order, within the budget, and what the retrieval did (``details``); only
        nodes of ``scope``'s documents when given.
        A failed query embedding raises (ClientError); an unusable selection reply, or a selection call failed for a
        transient reason, leaves that path empty and is counted; a refused selection call raises ``RequestRefused``."""
        config, forest, state = self.config, self.forest, _Question()
        cosine = forest.similarities(client.embed("embedder", [question])[0], scope)
        vector_docs = vector_documents(forest, cosine, config.top_k)
        llm_docs = self._select_documents(question, cosine, client, state)
        fused = llm_docs if config.mode == "llm-docs" else fuse_documents(llm_docs, vector_docs)
        doc_tokens = sum(forest.nodes[forest.roots[d]].n_tokens for d in fused)
        details: dict[str, Any] = {"mode": config.mode, "llm_documents": llm_docs, "vector_documents": vector_docs,
                                   "documents": fused, "budget": config.budget_tokens}
        if config.mode in DOCUMENT_MODES or (config.mode == "fable" and doc_tokens <= config.budget_tokens):
            details["route"], ordered = "documents", [forest.roots[d] for d in fused]
        else:
            details["route"], ordered = "nodes", self._node_level(question, fused, cosine, client, state, details)
        evidence = self._within_budget(ordered, state)
        details.update(nodes=[c.id for c in evidence], tokens=sum(c.n_tokens for c in evidence), **state.counts,
                       unparsed_replies=state.unparsed)
        return evidence, details

    def _node_level(self, question: str, fused: list[str], cosine: dict[str, float], client: Client,
                    state: _Question, details: dict[str, Any]) -> list[str]:
        """Node level, bi-path: LLM navigation and TreeExpansion over the fused documents, then NodeFusion. An LLM
        pick larger than the whole budget could never be returned and is left out (``oversized_selections``);
        when no node fits at all, the best candidate (the LLM's first pick, else the best score) is kept alone, to
        be cut to the budget."""
        config, forest = self.config, self.forest
        chosen = [] if config.mode == "treexp-nodes" else self._navigate(question, fused, client, state)
        fitting = [n for n in chosen if forest.nodes[n].n_tokens <= config.budget_tokens]
        state.counts["oversized_selections"] += len(chosen) - len(fitting)
        scores = {} if config.mode == "llm-nodes" else tree_expansion_scores(forest, fused, cosine)
        treexp = greedy_select(forest, scores, config.budget_tokens)
        details.update(llm_nodes=fitting, treexp_nodes=treexp)
        return node_fusion(forest, fitting + treexp, fused) or (chosen + sorted(scores, key=lambda n: -scores[n]))[:1]

    # ---- the LLM path

    def _select_documents(self, question: str, cosine: dict[str, float], client: Client, state: _Question
                          ) -> list[str]:
        """Document level: the LLM picks among the non-leaf nodes of depth <= L of the candidate documents."""
        best: dict[str, float] = {}
        for node_id, value in cosine.items():
            doc_id = self.forest.nodes[node_id].doc_id
            best[doc_id] = max(best.get(doc_id, value), value)
        corpus_order = [d for d in self.forest.documents if d in best]  # the scope's documents, when it has one
        candidates = set(sorted(corpus_order, key=lambda d: -best[d])[: self.config.llm_candidates])
        shown = [n for d in corpus_order if d in candidates for n in self.forest.subtree(self.forest.roots[d])
                 if self.forest.nodes[n].kind != "leaf" and self.forest.nodes[n].depth <= self.config.llm_depth]
        chosen = self._select(question, "documents", shown, client, state)
        return list(dict.fromkeys(self.forest.nodes[n].doc_id for n in chosen))

    def _navigate(self, question: str, doc_ids: Sequence[str], client: Client, state: _Question) -> list[str]:
        """Node level: the LLM picks among every non-leaf node of the selected documents."""
        shown = [n for d in doc_ids for n in self.forest.subtree(self.forest.roots[d])
                 if self.forest.nodes[n].kind != "leaf"]
        return self._select(question, "nodes", shown, client, state)

    def _select(self, question: str, step: str, node_ids: list[str], client: Client, state: _Question) -> list[str]:
        """One selection call over ``node_ids`` (the first ``llm_max_nodes``, numbered): the ids it names, in its
        order. An unusable reply counts under ``<step>_selection_unparsed``, ids out of range under
        ``<step>_selection_id_failures``, a request failed for a transient reason under ``request_failures``;
        ``<step>_nodes_hidden`` says how many nodes the prompt had no room for. A refused request (a 4xx other than
        408 and 429: a wrong role, a bad request) raises ``RequestRefused``: answering without the LLM path would
        hide it."""
        shown = node_ids[: self.config.llm_max_nodes]
        state.counts[f"{step}_nodes_hidden"] = len(node_ids) - len(shown)
        if not shown:
            return []
        lines = [f"{'  ' * (self.forest.nodes[n].depth - 1)}{self.forest.toc_path(n)}: "
                 f"{self.forest.nodes[n].summary[: self.config.max_summary_chars]}" for n in shown]
        what = "documents (with their main sections)" if step == "documents" else "the selected documents"
        prompt = SELECT_PROMPT.format(question=question, what=what, items=numbered(lines),
                                      k=self.config.llm_max_selected)
        try:
            raw = client.chat("generator", [{"role": "user", "content": prompt}], max_tokens=self.config.max_tokens,
                              temperature=0, response_format=selection_response_format(
                                  len(shown), self.config.llm_max_selected)).text
        except ClientError as exc:
            raise_if_refused(exc, f"FABLE's {step} selection (role 'generator')")
            state.counts["request_failures"] += 1
            state.unparsed.append({"step": step, "raw": f"<request failed: {exc}>"})
            return []
        parsed = parse_ids(raw, "ids", len(shown))
        if parsed is None:
            state.counts[f"{step}_selection_unparsed"] += 1
            state.unparsed.append({"step": step, "raw": raw})
            return []
        state.counts[f"{step}_selection_id_failures"] += parsed[1]
        return [shown[i] for i in parsed[0]]

    # ---- budget

    def _within_budget(self, ordered: list[str], state: _Question) -> list[Chunk]:
        """The budget's prefix of ``ordered`` as chunks; when not even the first node fits, that node cut to the
        budget (at its own characters per token; ``budget_truncations``) rather than nothing."""
        budget = self.config.budget_tokens
        kept = budget_prefix([self.forest.nodes[n].n_tokens for n in ordered], budget)
        state.counts["budget_truncations"] = int(kept == 0 and bool(ordered))
        if kept or not ordered:
            return [self.forest.chunk(n) for n in ordered[:kept]]
        whole = self.forest.chunk(ordered[0])
        chars = max(1, len(whole.text) * budget // max(whole.n_tokens, 1))
        return [replace(whole, text=whole.text[:chars], end=whole.start + chars, n_tokens=budget)]
