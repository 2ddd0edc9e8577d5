"""LATTICE as a strategy of the evaluation harness: the tree search ranks leaves, the generator answers from them.

The tree comes from ``overstory data lattice-tree`` over the same corpus (its leaves are that corpus's chunks at
``leaf_level``, rebuilt with the tree's hierarchy settings). The scorer is whatever the served ``scorer`` role is:
the LLM teacher, a distilled LoRA student, or a cross-encoder student (``scorer: cross_encoder``). A question with
a document scope is searched in the tree cut to its documents' leaves (``Tree.restricted``, made once per scope).

Updates (``with_documents`` / ``without_documents``, which ``Retriever`` swaps in) work on a copy of the tree: a new
document's leaves are placed by search-and-insert (the served scorer ranks the tree for each leaf's text), and a
cluster pushed past M (the tree's ``m_max``) is split locally by k-means on the served embedder; a removed document's
leaves go and a cluster left with fewer than two children is merged into its parent (``insert.remove_leaves``).
``save_index`` writes the tree with a manifest; ``load_index`` reads it back.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk, Document
from overstory.retrieval.answer import AnswerConfig, generate_answer
from overstory.retrieval.index_manifest import (
    check_contents,
    check_manifest,
    chunks_hash,
    read_manifest,
    write_manifest,
)
from overstory.retrieval.lattice.insert import insert_leaf, leaf_node, overfull_nodes, remove_leaves, split_overfull
from overstory.retrieval.lattice.keywords import fallback_keywords
from overstory.retrieval.lattice.scorers import CrossEncoderSlateScorer, LLMSlateScorer
from overstory.retrieval.lattice.search import SearchConfig, check_reach, search
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Tree
from overstory.retrieval.strategy import Retrieval, StrategyAnswer
from overstory.serving.client import Client


@dataclass(frozen=True)
class LatticeStrategyConfig:
    tree: str = ""  # a tree.json from `overstory data lattice-tree` over the same corpus
    leaf_level: str = "paragraph"  # the level the tree was built over
    scorer: Literal["llm", "cross_encoder"] = "llm"  # what the served `scorer` role is
    # cross_encoder: empty reads whether its scores are probabilities (sigmoid) or raw logits (identity) from each
    # response, as the embedded server reports; set it only for a server that does not say (vLLM's /score). Set and
    # reported otherwise, the search stops with a ConfigError naming both
    cross_encoder_activation: Literal["", "sigmoid", "identity"] = ""
    search: SearchConfig = field(default_factory=lambda: SearchConfig(iterations=4, top_k=10))
    max_tokens: int = 256  # per listwise slate reply
    max_candidate_chars: int = 300
    max_attempts: int = 2

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.max_candidate_chars < 1 or self.max_attempts < 1:
            raise ConfigError("lattice: max_tokens, max_candidate_chars and max_attempts must be >= 1")


LATTICE_KIND = "lattice"  # the kind a saved LATTICE index's manifest names
TREE_FILE = "tree.json"


class LatticeStrategy:
    name = "lattice"

    def __init__(self, tree: Tree, leaves: Sequence[Chunk], config: LatticeStrategyConfig, answer: AnswerConfig, *,
                 embedding_model: str | None = None, settings: Mapping[str, Any] | None = None):
        self.tree, self.config, self.answer_config = tree, config, answer
        # what a save records: the served embedder's model (splits cluster by it) and the hierarchy's settings
        self.embedding_model, self.settings = embedding_model, dict(settings or {})
        self.leaves = {c.id: c for c in leaves}
        missing = [n.id for n in tree.leaves() if n.id not in self.leaves]
        if missing:
            raise ConfigError(f"lattice.tree: {len(missing)} of its leaves (e.g. {missing[0]}) are not chunks of this "
                              "corpus; build the tree over the same corpus and hierarchy settings")
        # the whole tree's reach (an open-corpus search); a document scope's cut is checked when first searched
        check_reach(tree, config.search.iterations, "lattice.search.iterations")
        self._scoped: dict[frozenset[str], Tree] = {}
        self._lock = threading.Lock()

    def tree_for(self, scope: Sequence[str] | None) -> Tree:
        """The tree a question is searched in: the whole tree, or the one cut to the documents of ``scope`` (made
        once per scope, shared by the harness's threads; its reach checked then, as the whole tree's at build). A
        scope without a leaf in the tree is a tree built over another corpus: a ConfigError."""
        if scope is None:
            return self.tree
        key = frozenset(scope)
        with self._lock:
            if key not in self._scoped:
                cut = self.tree.restricted(key)
                if cut is None:
                    raise ConfigError(f"lattice.tree has no leaf of the document(s) {', '.join(sorted(key))}; build "
                                      "the tree over the corpus evaluated")
                check_reach(cut, self.config.search.iterations, "lattice.search.iterations",
                            f"the tree cut to {', '.join(sorted(key))}")
                self._scoped[key] = cut
            return self._scoped[key]

    def _scorer(self, client: Client):
        if self.config.scorer == "cross_encoder":
            return CrossEncoderSlateScorer(client, activation=self.config.cross_encoder_activation)
        return LLMSlateScorer(client, max_tokens=self.config.max_tokens, max_attempts=self.config.max_attempts,
                              max_candidate_chars=self.config.max_candidate_chars)

    def retrieve_evidence(self, question: str, client: Client, scope: Sequence[str] | None = None,
                          k: int | None = None) -> Retrieval:
        """Search the tree (cut to ``scope``'s documents, when given): the ranked leaves (the first ``k``, when
        given) with their path relevance, and the slates it scored in the details."""
        (result,) = search(self.tree_for(scope), [("q", question)], self._scorer(client), self.config.search)
        ranking = result.ranking[:k] if k else result.ranking
        details = {"slates": len(result.slates), "failed_slates": result.failed_slates, **result.problems}
        if result.slates and result.failed_slates == len(result.slates):
            # every slate failed: the ranking is the search's order without scores, still answered from it
            details["all_slates_failed"] = 1
        return Retrieval([self.leaves[node_id] for node_id, _ in ranking], [score for _, score in ranking],
                         details=details)

    def max_evidence(self) -> int:
        """The most leaves one search can rank: the tree's leaves."""
        return len(self.leaves)

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Search the tree (cut to ``scope``'s documents, when given) and answer from the ranked leaves."""
        found = self.retrieve_evidence(question, client, scope)
        return found.scored(generate_answer(question, found.evidence, client, self.answer_config, **found.details))

    # ---- persistence and updates

    def _derive(self, tree: Tree, leaves: Iterable[Chunk]) -> LatticeStrategy:
        return LatticeStrategy(tree, list(leaves), self.config, self.answer_config,
                               embedding_model=self.embedding_model, settings=self.settings)

    def save_index(self, folder: Path) -> None:
        """The tree (``tree.json``) and a manifest (the leaves' corpus hash, the embedding model, the leaf level and
        the hierarchy settings) in ``folder``: a part of a saved ``Retriever``, which keeps the chunks."""
        folder.mkdir(parents=True, exist_ok=True)
        self.tree.save(folder / TREE_FILE)
        leaves = list(self.leaves.values())
        write_manifest(folder, {"kind": LATTICE_KIND, "corpus_hash": chunks_hash(leaves), "n_chunks": len(leaves),
                                "n_documents": len({c.doc_id for c in leaves}),
                                "embedding_model": self.embedding_model,
                                "settings": {"leaf_level": self.config.leaf_level, "hierarchy": self.settings}})

    @classmethod
    def load_index(cls, folder: Path, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                   config: LatticeStrategyConfig, answer: AnswerConfig, *, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None) -> LatticeStrategy:
        """The strategy over the tree ``save_index`` wrote (``config.tree`` is not read), its leaves taken from
        ``chunks``; refused (``IndexMismatchError``) for another leaf level, embedding model or hierarchy settings,
        or leaves that differ from those saved."""
        manifest = read_manifest(folder)
        wanted = {"leaf_level": config.leaf_level, **({"hierarchy": dict(settings)} if settings is not None else {})}
        check_manifest(manifest, folder, embedding_model, wanted)
        tree = Tree.load(folder / TREE_FILE)
        in_tree = {node.id for node in tree.leaves()}
        leaves = [c for c in chunks if c.level == config.leaf_level and c.id in in_tree]
        check_contents(manifest, folder, LATTICE_KIND, len(leaves), chunks_hash(leaves))
        return cls(tree, leaves, config, answer, embedding_model=manifest.get("embedding_model"),
                   settings=manifest["settings"]["hierarchy"])

    def with_documents(self, documents: Sequence[Document], chunks: Sequence[Chunk], client: Client,
                       replace: bool = False) -> LatticeStrategy:
        """A strategy over a copy of the tree holding ``documents``' leaves (their chunks at the leaf level), each
        placed by search-and-insert through ``client``'s scorer; a cluster pushed past the tree's M is split.
        With ``replace``, the documents' old leaves go first. This strategy is left as it was."""
        ids = {d.id for d in documents}
        added = [c for c in chunks if c.level == self.config.leaf_level]
        if missing := sorted(ids - {c.doc_id for c in added}):
            raise ConfigError(f"lattice: document(s) {', '.join(missing[:3])} have no {self.config.leaf_level} chunk "
                              "to place in the tree")
        base = self.without_documents(ids) if replace else self
        tree = copy.deepcopy(base.tree)
        scorer = self._scorer(client)
        for chunk in added:
            insert_leaf(tree, leaf_node(chunk), scorer, self.config.search)
        self._split_overfull(tree, client)
        return self._derive(tree, [*base.leaves.values(), *added])

    def _split_overfull(self, tree: Tree, client: Client) -> None:
        """Split (k-means on the served embedder, in place) every cluster of ``tree`` past its M (``m_max``)."""
        m_max = tree.meta.get("m_max")
        if not m_max or not (overfull := overfull_nodes(tree, m_max)):
            return
        prefix = next(p for p in (f"split{n}-" for n in range(len(tree.nodes) + 1))
                      if not any(i.startswith(p) for i in tree.nodes))
        builder = TopDownBuilder(client, lambda texts: client.embed("embedder", texts), m_max=m_max, token_budget=0,
                                 id_prefix=prefix)
        keywords = {c: fallback_keywords(tree.nodes[c].display_text) for n in overfull for c in tree.nodes[n].children}
        split_overfull(tree, overfull, builder, keywords)

    def without_documents(self, doc_ids: Iterable[str]) -> LatticeStrategy:
        """A strategy over a copy of the tree without the leaves of ``doc_ids`` (a cluster left with fewer than two
        children merged into its parent; ``insert.remove_leaves``). This strategy is left as it was."""
        dropped = set(doc_ids)
        gone = [i for i, c in self.leaves.items() if c.doc_id in dropped]
        if not gone:
            return self
        tree = copy.deepcopy(self.tree)
        remove_leaves(tree, gone)
        return self._derive(tree, [c for c in self.leaves.values() if c.doc_id not in dropped])
