"""LATTICE as a strategy of the evaluation harness: the tree search ranks leaves, the generator answers from them.

The tree comes from ``overstory data lattice-tree`` over the same corpus (its leaves are that corpus's chunks at
``leaf_level``, rebuilt with the tree's hierarchy settings). The scorer is whatever the served ``scorer`` role is:
the LLM teacher, a distilled LoRA student, or a cross-encoder student (``scorer: cross_encoder``). A question with
a document scope is searched in the tree cut to its documents' leaves (``Tree.restricted``, made once per scope).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.answer import AnswerConfig, generate_answer
from overstory.retrieval.lattice.scorers import CrossEncoderSlateScorer, LLMSlateScorer
from overstory.retrieval.lattice.search import SearchConfig, check_reach, search
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


class LatticeStrategy:
    name = "lattice"

    def __init__(self, tree: Tree, leaves: Sequence[Chunk], config: LatticeStrategyConfig, answer: AnswerConfig):
        self.tree, self.config, self.answer_config = tree, config, answer
        self.leaves = {c.id: c for c in leaves}
        missing = [n.id for n in tree.leaves() if n.id not in self.leaves]
        if missing:
            raise ConfigError(f"lattice.tree: {len(missing)} of its leaves (e.g. {missing[0]}) are not chunks of this "
                              "corpus; build the tree over the same corpus and hierarchy settings")
        check_reach(tree, config.search.iterations, "lattice.search.iterations")
        self._scoped: dict[frozenset[str], Tree] = {}
        self._lock = threading.Lock()

    def tree_for(self, scope: Sequence[str] | None) -> Tree:
        """The tree a question is searched in: the whole tree, or the one cut to the documents of ``scope`` (made
        once per scope, shared by the harness's threads). A scope without a leaf in the tree is a tree built over
        another corpus: a ConfigError."""
        if scope is None:
            return self.tree
        key = frozenset(scope)
        with self._lock:
            if key not in self._scoped:
                cut = self.tree.restricted(key)
                if cut is None:
                    raise ConfigError(f"lattice.tree has no leaf of the document(s) {', '.join(sorted(key))}; build "
                                      "the tree over the corpus evaluated")
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

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Search the tree (cut to ``scope``'s documents, when given) and answer from the ranked leaves."""
        found = self.retrieve_evidence(question, client, scope)
        return found.scored(generate_answer(question, found.evidence, client, self.answer_config, **found.details))
