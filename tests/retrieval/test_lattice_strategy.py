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
