"""FABLE's retrieval paths as pure functions over a forest: the vector path's documents (``vector_documents``), the
document-level fusion (``fuse_documents``), TreeExpansion's scores and greedy selection (``tree_expansion_scores``,
``greedy_select``), NodeFusion (``node_fusion``) and budget control (``budget_prefix``). The strategy
(``strategy.FableStrategy``) runs them in the order of the paper's Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from overstory.retrieval.fable.forest import Forest


def tree_expansion_scores(forest: Forest, doc_ids: Iterable[str], cosine: dict[str, float]) -> dict[str, float]:
    """TreeExpansion's S(v) = (S_sim(v) + S_inh(v) + S_child(v)) / 3 for every node of ``doc_ids``, where
    S_sim(v) = cos(q, v) / depth(v) with the root at depth 1, S_inh(v) = the largest S_sim of v's ancestors, and
    S_child(v) = the mean S of v's children. Conventions: the root has no ancestors, so S_inh(root) = 0; a leaf has
    no children, so S_child(leaf) = 0. The divisor stays 3 for every node (the formula as written: an empty term
    adds nothing), which keeps all scores on one scale; an internal node therefore outscores a leaf of the same
    similarity and inheritance, and is taken when it fits the budget: it returns its leaves in context.

    >>> from overstory.core.records import Document
    >>> from overstory.retrieval.fable.forest import ForestNode
    >>> forest = Forest([Document("d", "D", "ab")], [
    ...     ForestNode("r", "d", "root", 1, None, ["l"], 0, 2, 2), ForestNode("l", "d", "leaf", 2, "r", [], 0, 2, 2)])
    >>> {k: round(v, 4) for k, v in tree_expansion_scores(forest, ["d"], {"r": 0.6, "l": 0.8}).items()}
    {'l': 0.3333, 'r': 0.3111}
    """
    scores: dict[str, float] = {}

    def score(node_id: str, inherited: float | None) -> float:
        node = forest.nodes[node_id]
        s_sim = cosine[node_id] / node.depth
        below = s_sim if inherited is None else max(inherited, s_sim)
        children = [score(child, below) for child in node.children]
        s_child = sum(children) / len(children) if children else 0.0
        scores[node_id] = (s_sim + (inherited or 0.0) + s_child) / 3
        return scores[node_id]

    for doc_id in doc_ids:
        score(forest.roots[doc_id], None)
    return scores


def greedy_select(forest: Forest, scores: dict[str, float], budget: int) -> list[str]:
    """TreeExpansion's selection: nodes by score (ties: the shallower, i.e. the ancestor, first; then document
    order), each taken if no ancestor of it is taken and it fits what is left of ``budget`` tokens; taking a node
    drops its taken descendants (it covers them) and gives their tokens back. Returns the taken ids, best first.

    >>> from overstory.core.records import Document
    >>> from overstory.retrieval.fable.forest import ForestNode
    >>> forest = Forest([Document("d", "D", "abcd")], [ForestNode("r", "d", "root", 1, None, ["a", "b"], 0, 4, 10),
    ...     ForestNode("a", "d", "leaf", 2, "r", [], 0, 2, 6), ForestNode("b", "d", "leaf", 2, "r", [], 2, 4, 4)])
    >>> scores = {"a": 0.9, "b": 0.5, "r": 0.4}
    >>> greedy_select(forest, scores, 10), greedy_select(forest, scores, 8)
    (['r'], ['a'])
    """
    ranked = sorted(scores, key=lambda n: (-scores[n], forest.nodes[n].depth, forest.position[n]))
    taken: list[str] = []
    used = 0
    for node_id in ranked:
        if any(a in taken for a in forest.ancestors(node_id)):
            continue
        covered = [t for t in taken if node_id in forest.ancestors(t)]
        cost = forest.nodes[node_id].n_tokens - sum(forest.nodes[t].n_tokens for t in covered)
        if used + cost <= budget:
            taken = [t for t in taken if t not in covered] + [node_id]
            used += cost
    return taken


def node_fusion(forest: Forest, node_ids: Iterable[str], doc_order: Sequence[str]) -> list[str]:
    """NodeFusion: the union of both paths' nodes without duplicates and without any node whose ancestor is in it,
    ordered by document (``doc_order``: the LLM's documents first) and within a document by position.

    >>> from overstory.core.records import Document
    >>> from overstory.retrieval.fable.forest import ForestNode
    >>> forest = Forest([Document("d", "D", "abcd"), Document("e", "E", "x")], [
    ...     ForestNode("r", "d", "root", 1, None, ["a", "b"], 0, 4, 4),
    ...     ForestNode("a", "d", "leaf", 2, "r", [], 0, 2, 2), ForestNode("b", "d", "leaf", 2, "r", [], 2, 4, 2),
    ...     ForestNode("s", "e", "root", 1, None, [], 0, 1, 1)])
    >>> node_fusion(forest, ["b", "a", "s", "b"], ["e", "d"]), node_fusion(forest, ["a", "r", "s"], ["d", "e"])
    (['s', 'a', 'b'], ['r', 's'])
    """
    kept = set(node_ids)
    kept = {n for n in kept if not kept.intersection(forest.ancestors(n))}
    rank = {doc_id: i for i, doc_id in enumerate(doc_order)}
    return sorted(kept, key=lambda n: (rank.get(forest.nodes[n].doc_id, len(rank)), forest.nodes[n].start,
                                       forest.nodes[n].depth))


def budget_prefix(n_tokens: Sequence[int], budget: int) -> int:
    """How many of the ordered nodes budget control keeps: the longest prefix whose tokens sum to at most
    ``budget`` (a node that does not fit ends the list; later, smaller nodes are not slipped in after it).

    >>> budget_prefix([50, 30, 40], 85), budget_prefix([50, 40, 10], 60), budget_prefix([90], 60)
    (2, 1, 0)
    """
    total = 0
    for i, n in enumerate(n_tokens):
        total += n
        if total > budget:
            return i
    return len(n_tokens)


def fuse_documents(llm_docs: Sequence[str], vector_docs: Sequence[str]) -> list[str]:
    """The document-level fusion: the LLM's documents first, then the vector path's, each once.

    >>> fuse_documents(["b", "a"], ["a", "c", "b"])
    ['b', 'a', 'c']
    """
    return list(dict.fromkeys([*llm_docs, *vector_docs]))


def vector_documents(forest: Forest, cosine: dict[str, float], top_k: int) -> list[str]:
    """Documents of the ``top_k`` nodes most similar to the query, by their best node (max aggregation)."""
    best = sorted(cosine, key=lambda n: (-cosine[n], forest.position[n]))[:top_k]
    return list(dict.fromkeys(forest.nodes[n].doc_id for n in best))
