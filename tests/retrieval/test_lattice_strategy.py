"""LATTICE as a harness strategy: a search that cannot reach a leaf is refused before any question is asked."""

from __future__ import annotations

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.lattice.search import SearchConfig, check_reach
from overstory.retrieval.lattice.strategy import LatticeStrategy, LatticeStrategyConfig
from overstory.retrieval.lattice.tree import Node, Tree


def two_level_tree() -> tuple[Tree, list[Chunk]]:
    """root -> a -> (l1, l2), root -> b -> l3: every leaf at depth 2."""
    nodes = {"root": Node("root", children=["a", "b"]), "a": Node("a", name="Physics", children=["l1", "l2"]),
             "b": Node("b", name="Music", children=["l3"])}
    nodes.update({leaf: Node(leaf, leaf=True, text=f"passage {leaf}", doc_id="d") for leaf in ("l1", "l2", "l3")})
    chunks = [Chunk(leaf, "d", "paragraph", f"passage {leaf}", None, [], 10 * i, 10 * i + 9, 2)
              for i, leaf in enumerate(("l1", "l2", "l3"))]
    return Tree("root", nodes), chunks


def test_fewer_iterations_than_the_leaves_depth_are_refused_naming_the_key():
    """Each iteration expands one level: one iteration scores a and b, never a leaf, so every question would be
    answered from no evidence (what a depth-3 SQuAD tree with iterations=2 did to 30 questions)."""
    tree, chunks = two_level_tree()
    with pytest.raises(ConfigError, match=r"lattice\.search\.iterations=1 cannot reach a leaf .* depth 2\)"):
        LatticeStrategy(tree, chunks, LatticeStrategyConfig(search=SearchConfig(iterations=1)), AnswerConfig())
    strategy = LatticeStrategy(tree, chunks, LatticeStrategyConfig(search=SearchConfig(iterations=2)), AnswerConfig())
    assert set(strategy.leaves) == {"l1", "l2", "l3"}


def test_leaves_deeper_than_the_iterations_are_counted_and_warned_about(caplog):
    """A bottom-up tree puts leaves at several depths: with l3 one level deeper (b -> c -> l3), two iterations reach
    l1 and l2 only, and the warning names the share and the setting that reaches all."""
    tree, _ = two_level_tree()
    tree.nodes["b"].children = ["c"]
    tree.nodes["c"] = Node("c", name="Jazz", children=["l3"])
    tree.refresh_parents()
    with caplog.at_level("WARNING", logger="overstory.retrieval.lattice.search"):
        assert check_reach(tree, 2, "lattice.search.iterations") == pytest.approx(2 / 3)
    assert "lattice.search.iterations=2 reaches 67% of this tree's leaves (depths 2 to 3)" in caplog.text
    assert "set lattice.search.iterations=3" in caplog.text
    caplog.clear()
    assert check_reach(tree, 3, "lattice.search.iterations") == 1.0 and not caplog.text


def test_a_scoped_search_checks_the_reach_of_the_tree_cut_to_its_documents(caplog):
    """A question searched within its document searches the tree cut to that document's leaves, whose depths differ
    from the whole tree's. Document d2 has l6 under a and l4, l3, l5 under b (l3 and l5 one level deeper, b -> c):
    cut to d2, a gives way to l6 and l3 and l5 sit at depth 3, out of two iterations' reach, while the cut to d (l1,
    l2 under a) is reached whole; the warning names the cut."""
    tree, chunks = two_level_tree()
    tree.nodes["a"].children = ["l1", "l2", "l6"]
    tree.nodes["b"].children = ["c", "l4"]
    tree.nodes["c"] = Node("c", name="Jazz", children=["l3", "l5"])
    for leaf in ("l3", "l4", "l5", "l6"):
        tree.nodes[leaf] = Node(leaf, leaf=True, text=f"passage {leaf}", doc_id="d2")
    tree.refresh_parents()
    chunks = chunks[:2] + [Chunk(leaf, "d2", "paragraph", f"passage {leaf}", None, [], 0, 9, 2)
                           for leaf in ("l3", "l4", "l5", "l6")]
    strategy = LatticeStrategy(tree, chunks, LatticeStrategyConfig(search=SearchConfig(iterations=2)), AnswerConfig())
    caplog.clear()  # the whole tree's warning, at build
    with caplog.at_level("WARNING", logger="overstory.retrieval.lattice.search"):
        assert strategy.tree_for(["d"]).root == "a" and not caplog.text
        strategy.tree_for(["d2"])
    assert "lattice.search.iterations=2 reaches 50% of the tree cut to d2's leaves (depths 1 to 3)" in caplog.text
