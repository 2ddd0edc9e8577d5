"""LATTICE's tree: invariants (every leaf exactly once, branching at most M, after inserts too), JSON round trip."""

from __future__ import annotations

import pytest

from overstory.retrieval.lattice.tree import Node, Tree, TreeError


def small_tree() -> Tree:
    nodes = {"root": Node("root", name="root", children=["a", "b"]),
             "a": Node("a", name="Physics", description="particles", children=["l1", "l2"]),
             "b": Node("b", name="Music", children=["l3"])}
    for leaf in ("l1", "l2", "l3"):
        nodes[leaf] = Node(leaf, leaf=True, text=f"passage {leaf}", doc_id=f"doc-{leaf}")
    return Tree("root", nodes)


def test_navigation_and_stats():
    tree = small_tree()
    tree.validate(max_branching=2, expected_leaves={"l1", "l2", "l3"})
    assert tree.path("l2") == ["root", "a", "l2"] and tree.depth("l2") == 2 and tree.parent("root") is None
    assert [n.id for n in tree.leaves("a")] == ["l1", "l2"]
    stats = tree.stats()
    assert (stats["leaves"], stats["internal"], stats["depth"]) == (3, 3, 2)
    assert stats["branching"]["max"] == 2 and stats["leaves_per_internal_node"]["max"] == 3
    assert tree.node("a").display_text == "Physics: particles" and tree.node("l1").display_text == "passage l1"


@pytest.mark.parametrize("breakage, message", [
    (lambda t: t.nodes["b"].children.append("l1"), "reached twice"),
    (lambda t: t.nodes["a"].children.append("ghost"), "names no node"),
    (lambda t: t.nodes.update(orphan=Node("orphan", leaf=True)), "not under the root"),
    (lambda t: t.nodes["b"].children.clear(), "internal node 'b' has no children"),
    (lambda t: t.nodes["l1"].children.append("l2"), "leaf 'l1' has children"),
])
def test_validate_names_the_broken_node(breakage, message):
    tree = small_tree()
    breakage(tree)
    with pytest.raises(TreeError, match=message):
        tree.validate()


def test_branching_and_expected_leaves_are_checked():
    tree = small_tree()
    with pytest.raises(TreeError, match="more than M=1"):
        tree.validate(max_branching=1)
    with pytest.raises(TreeError, match="1 leaves are missing"):
        tree.validate(expected_leaves={"l1", "l2", "l3", "l4"})


def test_insert_then_round_trip(tmp_path):
    tree = small_tree()
    tree.add_child("b", Node("l4", leaf=True, text="new passage", doc_id="doc-l4"))
    tree.validate(max_branching=2, expected_leaves={"l1", "l2", "l3", "l4"})
    assert tree.parent("l4") == "b"
    with pytest.raises(TreeError, match="already in the tree"):
        tree.add_child("a", Node("l4", leaf=True))
    with pytest.raises(TreeError, match="under leaf"):
        tree.add_child("l1", Node("l5", leaf=True))
    tree.meta["method"] = "hand-built"
    loaded = Tree.load(tree.save(tmp_path / "tree.json"))
    assert loaded.nodes == tree.nodes and loaded.meta == {"method": "hand-built"} and loaded.parent("l4") == "b"
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(TreeError, match="not a LATTICE tree file"):
        Tree.load(tmp_path / "other.json")
    with pytest.raises(FileNotFoundError, match="lattice-tree"):
        Tree.load(tmp_path / "missing.json")


def test_a_tree_cut_to_a_document_scope():
    """Cut to doc-l1 and doc-l3: b (one leaf left) hands l3 up to the root, a keeps l1 alone and hands it up too;
    cut to doc-l2 alone the root keeps its one leaf; a scope of one cluster's documents makes that cluster the root.
    The cut trees are valid and the original is untouched."""
    tree = small_tree()
    tree.meta["method"] = "hand-built"
    cut = tree.restricted(["doc-l1", "doc-l3"])
    cut.validate(expected_leaves={"l1", "l3"})
    assert (cut.root, cut.nodes["root"].children, cut.depth("l3")) == ("root", ["l1", "l3"], 1)
    assert cut.meta == {"method": "hand-built", "scope": ["doc-l1", "doc-l3"]}
    one = tree.restricted({"doc-l2"})
    assert (one.root, one.nodes["root"].children) == ("root", ["l2"])
    physics = tree.restricted(["doc-l1", "doc-l2"])
    assert physics.root == "a" and [n.id for n in physics.leaves()] == ["l1", "l2"] and physics.depth("l2") == 1
    assert tree.restricted(["doc-l9"]) is None
    tree.validate(max_branching=2, expected_leaves={"l1", "l2", "l3"})
    assert tree.nodes["root"].children == ["a", "b"] and tree.parent("l3") == "b"
