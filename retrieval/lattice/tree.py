"""LATTICE's semantic tree: internal nodes with a name and a description, leaves holding passages.

The tree is the index LATTICE searches instead of a vector index: an LLM builds it offline
(``retrieval.lattice.build_*``) and walks it at query time (``retrieval.lattice.search``). It is saved
as one JSON file (``Tree.save`` / ``Tree.load``) with the nodes in a flat list, so any tool can read it,
and checked by ``Tree.validate``: every leaf reachable exactly once, no cycles, no childless internal
node, branching at most M (inserts may push a cluster past M; ``validate(max_branching=None)`` then
checks the rest).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1


@dataclass
class Node:
    """One tree node. A leaf carries a passage (``text``, ``doc_id``); an internal node carries the
    cluster's ``name`` and ``description``, which is what the scorer reads when it ranks it."""

    id: str
    name: str = ""
    description: str = ""
    children: list[str] = field(default_factory=list)
    leaf: bool = False
    text: str = ""
    doc_id: str = ""
    keywords: list[str] = field(default_factory=list)

    @property
    def display_text(self) -> str:
        """What a scorer sees for this node: a leaf's passage, an internal node's name and description."""
        if self.leaf:
            return self.text
        return f"{self.name}: {self.description}" if self.description else self.name


class TreeError(ValueError):
    """A tree that breaks an invariant; the message names the node."""


@dataclass
class Tree:
    """Nodes by id plus the root's id; ``meta`` keeps how the tree was built (method, M, LLM cost)."""

    root: str
    nodes: dict[str, Node]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.refresh_parents()

    def refresh_parents(self) -> None:
        """Rebuild the child -> parent map (after editing ``children`` lists directly)."""
        self._parent: dict[str, str] = {c: n.id for n in self.nodes.values() for c in n.children}

    # --- navigation -------------------------------------------------------------------------------
    def node(self, node_id: str) -> Node:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise TreeError(f"no node {node_id!r} in the tree") from None

    def children(self, node_id: str) -> list[Node]:
        return [self.nodes[c] for c in self.node(node_id).children]

    def parent(self, node_id: str) -> str | None:
        return self._parent.get(node_id)

    def depth(self, node_id: str) -> int:
        """Edges from the root (the root is at depth 0)."""
        d, current = 0, node_id
        while (current := self.parent(current)) is not None:
            d += 1
        return d

    def path(self, node_id: str) -> list[str]:
        """Ids from the root down to ``node_id`` inclusive."""
        out = [node_id]
        while (up := self.parent(out[-1])) is not None:
            out.append(up)
        return out[::-1]

    def on_paths_to(self, leaf_ids: Iterable[str]) -> set[str]:
        """Every node on the way from the root to any of ``leaf_ids``, those included: the nodes that lead to them
        (a node leads to a leaf exactly when the leaf lies below it)."""
        return {node for leaf in leaf_ids for node in self.path(leaf)}

    def leaves(self, node_id: str | None = None) -> Iterator[Node]:
        """Leaves under ``node_id`` (the whole tree by default), left to right."""
        stack = [node_id or self.root]
        while stack:
            node = self.nodes[stack.pop()]
            if node.leaf:
                yield node
            else:
                stack.extend(reversed(node.children))

    # --- editing ----------------------------------------------------------------------------------
    def add_child(self, parent_id: str, child: Node) -> None:
        """Attach a new node under ``parent_id`` (search-and-insert uses this; no rebuild)."""
        parent = self.node(parent_id)
        if parent.leaf:
            raise TreeError(f"cannot attach {child.id!r} under leaf {parent_id!r}")
        if child.id in self.nodes:
            raise TreeError(f"node id {child.id!r} is already in the tree")
        self.nodes[child.id] = child
        parent.children.append(child.id)
        self._parent[child.id] = parent_id

    def restricted(self, doc_ids: Collection[str]) -> Tree | None:
        """The tree cut to the leaves of the documents ``doc_ids`` (a question's document scope); None when it has
        none. An internal node left without leaves goes; one left with a single child is replaced by that child,
        so the search spends no scorer call on a slate of one candidate (a root left with one internal child
        hands the root over to it; with one leaf, it stays). ``meta["scope"]`` records the documents; the original
        tree is not changed.

        >>> tree = Tree("r", {"r": Node("r", children=["a", "b"]), "a": Node("a", children=["x", "y"]),
        ...                   "b": Node("b", children=["z"]), "x": Node("x", leaf=True, doc_id="d1"),
        ...                   "y": Node("y", leaf=True, doc_id="d2"), "z": Node("z", leaf=True, doc_id="d1")})
        >>> cut = tree.restricted({"d1"})
        >>> cut.root, cut.nodes["r"].children, sorted(cut.nodes), tree.restricted({"d9"})
        ('r', ['x', 'z'], ['r', 'x', 'z'], None)
        >>> only = tree.restricted(["d2"])
        >>> only.root, only.nodes["r"].children, cut.validate(), tree.nodes["r"].children
        ('r', ['y'], None, ['a', 'b'])
        """
        scope = set(doc_ids)
        kept: dict[str, Node] = {}

        def keep(node_id: str) -> str | None:
            node = self.nodes[node_id]
            if node.leaf:
                if node.doc_id not in scope:
                    return None
                kept[node_id] = node
                return node_id
            children = [k for k in (keep(c) for c in node.children) if k is not None]
            if len(children) > 1 or (node_id == self.root and children and kept[children[0]].leaf):
                kept[node_id] = replace(node, children=children)
                return node_id
            return children[0] if children else None

        top = keep(self.root)
        if top is None:
            return None
        return Tree(top, kept, {**self.meta, "scope": sorted(scope)})

    # --- checks and statistics --------------------------------------------------------------------
    def validate(self, max_branching: int | None = None, expected_leaves: set[str] | None = None) -> None:
        """Raise ``TreeError`` unless the nodes form one tree under the root in which every node is
        reached exactly once, leaves have no children, internal nodes have some, and (when given) no
        node has more than ``max_branching`` children and the leaves are exactly ``expected_leaves``."""
        if self.root not in self.nodes:
            raise TreeError(f"root {self.root!r} is not a node")
        seen: set[str] = set()
        stack = [self.root]
        while stack:
            node_id = stack.pop()
            if node_id in seen:
                raise TreeError(f"node {node_id!r} is reached twice (a cycle or a shared child)")
            seen.add(node_id)
            node = self.nodes.get(node_id)
            if node is None:
                raise TreeError(f"a child id {node_id!r} names no node")
            if node.leaf and node.children:
                raise TreeError(f"leaf {node_id!r} has children")
            if not node.leaf and not node.children:
                raise TreeError(f"internal node {node_id!r} has no children")
            if max_branching is not None and len(node.children) > max_branching:
                raise TreeError(f"node {node_id!r} has {len(node.children)} children, more than M={max_branching}")
            stack.extend(node.children)
        if unreached := set(self.nodes) - seen:
            raise TreeError(f"{len(unreached)} nodes are not under the root, e.g. {sorted(unreached)[:3]}")
        if expected_leaves is not None:
            leaves = {n.id for n in self.nodes.values() if n.leaf}
            if missing := expected_leaves - leaves:
                raise TreeError(f"{len(missing)} leaves are missing, e.g. {sorted(missing)[:3]}")
            if extra := leaves - expected_leaves:
                raise TreeError(f"{len(extra)} unexpected leaves, e.g. {sorted(extra)[:3]}")

    def stats(self) -> dict[str, Any]:
        """Depth, branching and leaves per internal node (what ``overstory data lattice-tree stats`` prints)."""
        internal = [n for n in self.nodes.values() if not n.leaf]
        branching = [len(n.children) for n in internal]
        leaves_per_node = [sum(1 for _ in self.leaves(n.id)) for n in internal]
        leaf_depths = [self.depth(n.id) for n in self.nodes.values() if n.leaf]

        def summary(values: list[int]) -> dict[str, float]:
            if not values:
                return {"min": 0, "mean": 0.0, "median": 0.0, "max": 0}
            return {"min": min(values), "mean": round(statistics.fmean(values), 2),
                    "median": statistics.median(values), "max": max(values)}

        return {"nodes": len(self.nodes), "leaves": len(leaf_depths), "internal": len(internal),
                "depth": max(leaf_depths, default=0), "leaf_depth": summary(leaf_depths),
                "branching": summary(branching), "leaves_per_internal_node": summary(leaves_per_node)}

    # --- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": "overstory.lattice.tree", "version": FORMAT_VERSION, "root": self.root,
                   "meta": self.meta, "nodes": [asdict(n) for n in self.nodes.values()]}
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(payload, ensure_ascii=False))
        tmp.replace(path)  # a killed save never leaves half a tree behind
        return path

    @classmethod
    def load(cls, path: str | Path) -> Tree:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no LATTICE tree at {path}; build one with `overstory data lattice-tree`")
        payload = json.loads(path.read_text())
        if payload.get("format") != "overstory.lattice.tree":
            raise TreeError(f"{path} is not a LATTICE tree file (format={payload.get('format')!r})")
        if payload.get("version") != FORMAT_VERSION:
            raise TreeError(f"{path} has tree format version {payload.get('version')}; this code reads "
                            f"{FORMAT_VERSION}")
        nodes = {raw["id"]: Node(**raw) for raw in payload["nodes"]}
        return cls(root=payload["root"], nodes=nodes, meta=payload.get("meta", {}))
