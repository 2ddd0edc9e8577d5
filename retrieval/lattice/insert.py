"""Search-and-insert (the LATTICE paper's B.9): add a document to a built tree without rebuilding it.

The new leaf's own text is the query: the search walks the tree as it would for a question, and the leaf is
attached beside the best-ranked leaf, under that leaf's cluster (its parent). Nothing else moves, so the
tree stays valid and every other path is unchanged.

When that cluster then holds more than M children, the tree is still a valid tree but breaks the branching
bound the search's cost relies on (a slate is a node's children: an overfull cluster makes longer prompts).
``split_overfull`` repairs it locally: the cluster's children are split by the same builder that built the
tree (LLM clustering of their keyword summaries, or k-means) into new internal nodes under it, so only that
cluster's subtree changes. Inserting without splitting is allowed (``validate(max_branching=None)``); the
overfull clusters are listed by ``overfull_nodes``.
"""

from __future__ import annotations

from collections.abc import Iterable

from overstory.retrieval.lattice.scorers import SlateScorer
from overstory.retrieval.lattice.search import SearchConfig, search
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree, TreeError


def insert_leaf(tree: Tree, leaf: Node, scorer: SlateScorer, config: SearchConfig | None = None,
                max_query_chars: int = 1000) -> str:
    """Attach ``leaf`` under the cluster of the best leaf the search finds for its text; returns that cluster's id.

    A tree whose root holds only leaves, or a search that reaches no leaf, puts it under the root."""
    if not leaf.leaf:
        raise TreeError(f"{leaf.id!r} is not a leaf")
    [result] = search(tree, [(f"insert:{leaf.id}", leaf.text[:max_query_chars])], scorer, config or SearchConfig())
    parent = tree.parent(result.ranking[0][0]) if result.ranking else None
    parent = parent or tree.root
    tree.add_child(parent, leaf)
    return parent


def overfull_nodes(tree: Tree, m_max: int) -> list[str]:
    """Internal nodes with more than ``m_max`` children."""
    return [n.id for n in tree.nodes.values() if not n.leaf and len(n.children) > m_max]


def split_overfull(tree: Tree, node_ids: Iterable[str], builder: TopDownBuilder,
                   keywords: dict[str, list[str]]) -> int:
    """Re-cluster the children of each overfull node in place with ``builder`` (built with the tree's M and an
    ``id_prefix`` unused in the tree); returns how many internal nodes were added. A child that is itself a
    cluster takes part through its name and description and moves down with its whole subtree."""
    added = 0
    for node_id in list(node_ids):
        node = tree.node(node_id)
        # the builder sees every child as a leaf-like item with text; the tree keeps the real child nodes
        items = [Node(id=c, leaf=True, text=tree.nodes[c].display_text) for c in node.children]
        summaries = {item.id: keywords.get(item.id) or [item.text] * 5 for item in items}
        sub = builder.build(items, summaries)
        for sub_node in sub.nodes.values():
            if not sub_node.leaf and sub_node.id != sub.root:
                if sub_node.id in tree.nodes:
                    raise TreeError(f"the builder's id {sub_node.id!r} is already in the tree: give it another "
                                    f"id_prefix")
                tree.nodes[sub_node.id] = sub_node
                added += 1
        node.children = list(sub.node(sub.root).children)
    tree.refresh_parents()
    return added
