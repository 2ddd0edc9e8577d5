"""Where a tree search loses the gold: for each depth of the node it expanded, how many slates it scored, how many
held a candidate that leads to a gold leaf (the leaf itself or one of its ancestors), and in how many of those such
a candidate got the slate's top score (ties included).

A search whose final ranking misses the gold either never reached a slate holding it (the upper levels' choices lost
it) or reached it and ranked it below a sibling (the scorer, at that depth). nDCG@10 alone cannot tell the two apart;
this table can, for the teacher (from its traces) and each student (from its own search) alike, so a weak teacher is
diagnosed level by level rather than only scored. Calibration leaves added to a slate from elsewhere in the tree are
not its expanded node's children and are left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from overstory.core.plots import plt, save_figure
from overstory.evaluation.markdown import grid
from overstory.retrieval.lattice.tree import Tree


@dataclass(frozen=True)
class ScoredSlate:
    """What the routing count needs of one slate: its question, the node expanded, the candidates and their raw
    scores (``None``: left unscored)."""

    query_id: str
    expanded: str
    node_ids: Sequence[str]
    scores: Sequence[float | None]


def gold_routing(tree: Tree, gold: Mapping[str, set[str]], slates: Iterable[ScoredSlate]) -> dict[str, dict[str, int]]:
    """Per depth of the expanded node (``"0"``: the root): ``slates``, ``with_gold`` (a child that leads to gold is
    on the slate) and ``gold_first`` (such a child has the slate's top score). Slates of questions outside ``gold``
    are skipped.

    >>> from overstory.retrieval.lattice.tree import Node
    >>> tree = Tree("r", {"r": Node("r", children=["a", "b"]), "a": Node("a", children=["x", "y"]),
    ...                   "b": Node("b", children=["z"]), "x": Node("x", leaf=True), "y": Node("y", leaf=True),
    ...                   "z": Node("z", leaf=True)})
    >>> gold_routing(tree, {"q": {"y"}}, [ScoredSlate("q", "r", ["a", "b"], [40.0, 90.0]),
    ...                                   ScoredSlate("q", "a", ["x", "y", "z"], [10.0, 80.0, 95.0])])
    {'0': {'slates': 1, 'with_gold': 1, 'gold_first': 0}, '1': {'slates': 1, 'with_gold': 1, 'gold_first': 1}}
    """
    leading = {qid: tree.on_paths_to(leaves) for qid, leaves in gold.items()}
    counts: dict[int, dict[str, int]] = {}
    for slate in slates:
        if slate.query_id not in leading:
            continue
        children = [(node, score) for node, score in zip(slate.node_ids, slate.scores, strict=True)
                    if tree.parent(node) == slate.expanded]
        row = counts.setdefault(tree.depth(slate.expanded), {"slates": 0, "with_gold": 0, "gold_first": 0})
        row["slates"] += 1
        on_path = [score for node, score in children if node in leading[slate.query_id]]
        if not on_path:
            continue
        row["with_gold"] += 1
        scored = [score for _, score in children if score is not None]
        best_gold = max((score for score in on_path if score is not None), default=None)
        if best_gold is not None and best_gold >= max(scored):
            row["gold_first"] += 1
    return {str(depth): counts[depth] for depth in sorted(counts)}


def routing_table(systems: Mapping[str, Mapping]) -> str:
    """One row per system with a ``routing`` entry, one column per depth: ``with_gold/slates`` and, after the
    arrow, ``gold_first``.

    >>> print(routing_table({"teacher": {"routing": {"0": {"slates": 4, "with_gold": 4, "gold_first": 3}}},
    ...                      "bm25": {}}))
    | system | depth 0 |
    | --- | --- |
    | teacher | 4/4 -> 3 |
    <BLANKLINE>
    """
    rows = {name: row["routing"] for name, row in systems.items() if row.get("routing")}
    depths = sorted({int(depth) for routing in rows.values() for depth in routing})
    cells = [[name, *(f"{r['with_gold']}/{r['slates']} -> {r['gold_first']}" if (r := routing.get(str(d))) else "-"
                      for d in depths)] for name, routing in rows.items()]
    return grid(["system", *(f"depth {d}" for d in depths)], cells)


def plot_routing(systems: Mapping[str, Mapping], path: str | Path) -> Path:
    """Two panels by depth, a line per system: the share of slates holding a gold-leading child, and the share of
    those where it was scored first."""
    fig, (ax_held, ax_first) = plt.subplots(1, 2, figsize=(11.0, 4.2), sharey=True)
    for name, row in systems.items():
        routing = row.get("routing")
        if not routing:
            continue
        depths = sorted(int(d) for d in routing)
        stats = [routing[str(d)] for d in depths]
        ax_held.plot(depths, [s["with_gold"] / s["slates"] for s in stats], marker="o", label=name)
        ax_first.plot(depths, [s["gold_first"] / s["with_gold"] if s["with_gold"] else float("nan") for s in stats],
                      marker="o", label=name)
    ax_held.set_title("slates holding a child that leads to gold")
    ax_first.set_title("of those, that child scored first")
    for ax in (ax_held, ax_first):
        ax.set_xlabel("depth of the expanded node (0: root)")
        ax.set_ylim(0, 1.05)
    ax_held.set_ylabel("share of slates")
    ax_first.legend(fontsize=8)
    return save_figure(fig, path)
