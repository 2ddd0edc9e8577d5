"""`overstory data lattice-tree`: keyword summaries and top-down LLM clustering with the real built-in model on a
slice of the HotpotQA sample, resume, the tree's invariants, and the reply rules (dropped and duplicated
summaries) of the clustering."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from overstory.cli import main
from overstory.core.records import read_jsonl
from overstory.retrieval.lattice.keywords import LEVEL_WORDS
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree

ROOT = Path(__file__).resolve().parents[2]


# The smallest real slice that keeps every check able to fail: 5 leaves in 2 keyword batches (4 + 1), so there are
# two keyword calls; M = 3, so a level of the 5 leaves' summaries has more than M distinct ones and the clustering
# asks the model (with M = 4 none had: k-means only, no clustering call). One clustering attempt of 64 tokens: the
# check is that the call is made and counted and every leaf placed (by the reply or, counted, by k-means); measured,
# SmolLM2's greedy reply under the schema runs past 512 tokens, so it is cut at any of these lengths and k-means
# places every leaf (no_reply_kmeans): a longer or second attempt only costs time (about 7 tokens/s under the schema).
LEAVES, M_MAX = 5, 3


def _run(out: Path, *extra: str) -> int:
    return main(["data", "lattice-tree", "--config", str(ROOT / "configs/data/lattice_tree.yaml"), f"out={out}",
                 f"corpus.path={ROOT / 'data/hotpotqa'}", f"limit_leaves={LEAVES}", "keywords.batch_size=4",
                 "keywords.max_tokens=512", "keywords.max_attempts=1", f"clustering.m_max={M_MAX}",
                 "clustering.max_tokens=64", "clustering.max_attempts=1", "tracking.backend=none", *extra])


@pytest.mark.slow
def test_real_tree_build_and_resume(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tree"
    assert _run(out) == 0
    tree = Tree.load(out / "tree.json")
    leaves = {r["id"] for r in read_jsonl(out / "keywords.jsonl")}
    assert len(leaves) == LEAVES
    tree.validate(max_branching=M_MAX, expected_leaves=leaves)  # every leaf exactly once, at most M children
    assert all(n.name for n in tree.nodes.values() if not n.leaf)
    for record in read_jsonl(out / "keywords.jsonl"):
        assert len(record["keywords"]) == len(LEVEL_WORDS) and all(record["keywords"])
        assert record["source"] in {"llm", "fallback"}
    report = json.loads((out / "build.json").read_text())
    assert report["keywords"]["llm_calls"] >= 2 and report["keywords"]["prompt_tokens"] > 0
    assert report["keywords"]["leaves_llm"] + report["keywords"]["leaves_fallback"] == LEAVES
    assert report["clustering"]["llm_calls"] >= 1 and report["stats"]["leaves"] == LEAVES
    placed = report["clustering"]["placements"]
    assert sum(v for k, v in placed.items() if k != "invented_ignored") >= LEAVES  # each split places every leaf
    # resume: the summaries are on disk, so a rerun asks for none (k-means only here: no level fits budget 0)
    assert _run(out, "clustering.token_budget=0") == 0
    again = json.loads((out / "build.json").read_text())
    assert again["keywords"]["llm_calls"] == 0 and again["keywords"]["leaves_skipped_done"] == LEAVES
    assert again["clustering"]["llm_calls"] == 0 and again["clustering"]["placements"]["no_level_kmeans"] >= LEAVES
    assert main(["data", "lattice-tree-stats", f"tree={out / 'tree.json'}"]) == 0
    assert f'"leaves": {LEAVES}' in capsys.readouterr().out


class ScriptedClusterModel:
    """Stands in for the cluster model with one fixed reply that drops a summary and lists another in two
    clusters: a real tiny model under a grammar cannot be made to do either on demand."""

    def __init__(self, reply: str):
        self.reply, self.calls = reply, 0

    def chat(self, role, messages, **params):
        from overstory.serving.client import ChatResult

        self.calls += 1
        return ChatResult(self.reply, "stop", {"prompt_tokens": 10, "completion_tokens": 5}, 0.0, {})


def test_dropped_and_duplicated_summaries_are_placed_by_the_stated_rules() -> None:
    topics = ["physics"] * 3 + ["chemistry"] * 3 + ["music"] * 2 + ["painting"] * 2 + ["football"]
    leaves = [Node(id=f"l{i}", leaf=True, text=f"a passage about {t}") for i, t in enumerate(topics)]
    keywords = {leaf.id: [t, t, t, t, t] for leaf, t in zip(leaves, topics, strict=True)}
    reply = json.dumps({"clusters": [
        {"name": "Science", "description": "natural sciences", "keywords": ["physics", "chemistry", "music"]},
        {"name": "Arts", "description": "music and painting, the arts", "keywords": ["music", "painting", "opera"]},
    ]})  # "football" is dropped, "music" listed twice, "opera" invented

    def embed(texts):  # a deterministic bag-of-words embedding: football is nearest to nothing but sport words
        vocab = ["physics", "chemistry", "science", "music", "painting", "arts", "football", "sport"]
        return np.array([[t.lower().count(w) + 0.01 for w in vocab] for t in texts], dtype=np.float32)

    builder = TopDownBuilder(ScriptedClusterModel(reply), embed=embed, m_max=3, m_min=2)
    tree = builder.build(leaves, keywords)
    tree.validate(max_branching=3, expected_leaves={leaf.id for leaf in leaves})
    placed = builder.stats.placements
    assert placed["llm_duplicate_balanced"] == 2  # music: listed by both, goes to the smaller cluster (Arts)
    assert placed["dropped_by_llm_embedded"] == 1 and placed["invented_ignored"] == 1
    by_name = {n.name: n for n in tree.nodes.values() if not n.leaf}
    arts = {leaf.id for leaf in tree.leaves(by_name["Arts"].id)}
    assert {f"l{i}" for i in (6, 7, 8, 9)} <= arts  # music and painting
    assert Counter(topics[int(leaf.id[1:])] for leaf in tree.leaves(by_name["Science"].id))["music"] == 0
