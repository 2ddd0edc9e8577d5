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

Removal (``remove_leaves``) is the other way round: the leaves go, and a cluster that leaves its lower bound (two
children: the builders make no cluster of one) is merged into its parent, its one child taking its place, or dropped
when it has none; a root left with a single cluster hands the root over to it. Only the clusters that lost a child
(and, by a merge, their parents) change.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from overstory.core.records import Chunk
from overstory.retrieval.lattice.scorers import SlateScorer
from overstory.retrieval.lattice.search import SearchConfig, search
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree, TreeError


def leaf_node(chunk: Chunk) -> Node:
    """A chunk as a tree leaf, as the tree builders make them (``overstory data lattice-tree``): its id, document,
    and its text after its document's title."""
    return Node(id=chunk.id, leaf=True, text=f"{chunk.title}: {chunk.text}" if chunk.title else chunk.text,
                doc_id=chunk.doc_id)


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


def remove_leaves(tree: Tree, leaf_ids: Collection[str]) -> int:
    """Remove the leaves ``leaf_ids`` from ``tree`` in place and merge what left its bounds (see the module
    docstring); returns how many clusters were merged away. Removing every leaf is a TreeError."""
    gone = set(leaf_ids)
    if unknown := sorted(i for i in gone if i not in tree.nodes or not tree.nodes[i].leaf):
        raise TreeError(f"not leaves of the tree: {', '.join(unknown[:3])}")
    if not any(n.leaf and n.id not in gone for n in tree.nodes.values()):
        raise TreeError("removing every leaf would leave the tree empty")
    pending = {tree.parent(i) for i in gone}
    for leaf_id in gone:
        tree.nodes[tree.parent(leaf_id)].children.remove(leaf_id)
        del tree.nodes[leaf_id]
    tree.refresh_parents()
    merged = 0
    while pending:
        node_id = max(pending, key=lambda i: (tree.depth(i), i))  # deepest first: a merge may unbalance the parent
        pending.discard(node_id)
        parent = tree.parent(node_id)
        if _merge_if_under(tree, node_id):
            merged += 1
            if parent is not None:
                pending.add(parent)
    return merged


def _merge_if_under(tree: Tree, node_id: str) -> bool:
    """Merge cluster ``node_id`` away when it holds fewer than two children (a root only when its one child is a
    cluster, which becomes the root); True when it was."""
    node, parent = tree.nodes[node_id], tree.parent(node_id)
    if len(node.children) >= 2:
        return False
    if parent is None:
        if not node.children or tree.nodes[node.children[0]].leaf:
            return False
        tree.root = node.children[0]
    else:
        siblings = tree.nodes[parent].children
        at = siblings.index(node_id)
        siblings[at:at + 1] = node.children
    del tree.nodes[node_id]
    tree.refresh_parents()
    return True
