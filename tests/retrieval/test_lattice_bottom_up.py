"""Bottom-up and hybrid LATTICE trees: balanced grouping, the summary reply's parsing, and both constructions through
`overstory data lattice-tree` with the real built-in model (HotpotQA paragraphs bottom-up; a QASPER paper's own
sections and paragraphs under the hybrid)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from overstory.cli import main
from overstory.core.progress import JobProgress
from overstory.data_pipeline import fanout
from overstory.retrieval.lattice.bottom_up import (
    BottomUpBuilder,
    GroupOutcome,
    GroupSummary,
    balanced_groups,
    parse_summary,
)
from overstory.retrieval.lattice.tree import Node, Tree

ROOT = Path(__file__).resolve().parents[2]


def test_balanced_groups_partition_within_m() -> None:
    vectors = np.random.default_rng(0).normal(size=(37, 8)).astype(np.float32)
    groups = balanced_groups(vectors, m_max=5)
    assert max(len(g) for g in groups) <= 5 and sorted(i for g in groups for i in g) == list(range(37))
    same = balanced_groups(np.ones((9, 4), dtype=np.float32), m_max=4)  # k-means cannot separate them
    assert sorted(len(g) for g in same) == [3, 3, 3]


def _text_vectors(texts: list[str]) -> np.ndarray:
    """A fixed random vector per text (seeded by its hash): clusters with no structure to find."""
    return np.stack([np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).normal(size=16)
                     for t in texts]).astype(np.float32)


def _name_by_key(call, requests, handle) -> None:
    """A group map that names each group by its key, asking no model: the test is about the tree's shape."""
    for request in requests:
        handle(request, GroupOutcome(GroupSummary(request.key, request.key[:9], request.key, []), None, None, {}))


def test_bottom_up_layers_branch_evenly_up_to_the_root() -> None:
    """150 leaves under M = 10: grouping each layer by M alone left a root of two children holding 84 and 66 leaves
    (on HotpotQA's 400 paragraphs, one group of nearly all of them and a stray: the teacher's first step chose
    nothing). Each layer's group size now lets the layers above branch evenly."""
    leaves = [Node(id=f"p{i}", leaf=True, text=f"passage {i}") for i in range(150)]
    tree = BottomUpBuilder(_name_by_key, _text_vectors, m_max=10).build(leaves)
    tree.validate(max_branching=10, expected_leaves={leaf.id for leaf in leaves})
    under_root = sorted((len(list(tree.leaves(child))) for child in tree.nodes[tree.root].children), reverse=True)
    assert len(under_root) >= 4 and under_root[0] <= len(leaves) // 3, under_root


def test_parse_summary_takes_the_last_usable_object() -> None:
    text = 'draft {"common_theme": "x"} final {"detailed_fingerprints": "not a list", "common_theme": "Films", ' \
           '"summary": "American films of the 1990s."}'
    assert parse_summary(text) == ("Films", "American films of the 1990s.", [])
    assert parse_summary("no json here") is None


def _build(out: Path, *extra: str) -> dict:
    assert main(["data", "lattice-tree", "--config", str(ROOT / "configs/data/lattice_tree.yaml"), f"out={out}",
                 "clustering.m_max=4", "summaries.max_tokens=160", "tracking.backend=none", *extra]) == 0
    return json.loads((out / "build.json").read_text())


@pytest.mark.slow
def test_bottom_up_tree_with_the_real_model(tmp_path: Path, monkeypatch) -> None:
    runs: list[dict] = []  # the fan-out's bars: one run per layer's node summaries

    class RecordingProgress(JobProgress):
        def add_task(self, description, **fields):
            runs.append({"description": description, "total": fields["total"], "completed": 0})
            return super().add_task(description, **fields)

        def advance(self, task_id, advance=1) -> None:
            runs[-1]["completed"] += advance
            super().advance(task_id, advance)

    monkeypatch.setattr(fanout, "JobProgress", RecordingProgress)
    report = _build(tmp_path, "method=bottom-up", f"corpus.path={ROOT / 'data/hotpotqa'}", "limit_leaves=12")
    tree = Tree.load(tmp_path / "tree.json")
    tree.validate(max_branching=4)
    internal = [n for n in tree.nodes.values() if not n.leaf and n.id != tree.root]
    assert report["method"] == "bottom-up" and report["stats"]["leaves"] == 12 and report["stats"]["depth"] >= 2
    placed = report["summaries"]["placements"]
    # every new node was summarised once, by the model or (counted) by the fallback
    assert placed.get("summaries_llm", 0) + placed.get("summaries_fallback", 0) == len(internal)
    assert report["summaries"]["llm_calls"] >= len(internal) and report["summaries"]["prompt_tokens"] > 0
    assert all(n.name and n.description for n in internal)
    # each layer's summaries were a run of the job's fan-out, every one of them done; together, every new node
    assert runs and all(run["description"] == "node summaries" for run in runs)
    assert all(run["completed"] == run["total"] for run in runs) and sum(r["total"] for r in runs) == len(internal)


# The shortest shipped QASPER paper (21 paragraphs in 5 sections and 7 subsections; the first paper, which limit_leaves
# picked, has 35 in 7 and 16): still more than M=4 paragraphs, sections and subsections, so the hybrid keeps sections
# and groups inside them (depth 5), with 10 node summaries to write instead of 22
SHORT_PAPER = "1604.05559"


def _one_paper(folder: Path, paper_id: str) -> Path:
    """The shipped QASPER dev file cut to one paper (the official layout, keyed by arXiv id)."""
    papers = json.loads((ROOT / "data/qasper/dev.json").read_text())
    folder.mkdir()
    (folder / "dev.json").write_text(json.dumps({paper_id: papers[paper_id]}))
    return folder / "dev.json"


@pytest.mark.slow
def test_hybrid_tree_keeps_a_papers_sections(tmp_path: Path) -> None:
    corpus = _one_paper(tmp_path / "qasper", SHORT_PAPER)
    report = _build(tmp_path / "tree", "method=hybrid", "corpus.kind=qasper", f"corpus.path={corpus}",
                    "limit_leaves=10")
    tree = Tree.load(tmp_path / "tree" / "tree.json")
    tree.validate(max_branching=4)
    leaves = [n for n in tree.nodes.values() if n.leaf]
    assert report["method"] == "hybrid" and len(leaves) >= 10  # whole papers: the tenth leaf's paper is complete
    # each paper is one subtree: the node named by its title holds every paragraph of that paper and no other
    papers = {n.doc_id for n in leaves}
    for node in tree.nodes.values():
        if not node.leaf and node.doc_id and tree.parent(node.id) is not None:
            assert {leaf.doc_id for leaf in tree.leaves(node.id)} == {node.doc_id}
    paper_nodes = [n for n in tree.nodes.values() if not n.leaf and n.doc_id and
                   {leaf.id for leaf in tree.leaves(n.id)} == {leaf.id for leaf in leaves if leaf.doc_id == n.doc_id}]
    assert {n.doc_id for n in paper_nodes} == papers
    # a paper's sections are kept as nodes below it (a QASPER paper has more than M paragraphs)
    assert report["stats"]["depth"] >= 3
