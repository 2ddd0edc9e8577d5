"""LATTICE's search over a tree of the shipped HotpotQA sample: the oracle reaches the gold (the tree and the
search lose no gold leaf), damaged replies keep their valid scores, and the real built-in model drives it end to end.

The tree here is built top-down with ``token_budget=0``: no summary level fits, so every split is k-means on
the real MiniLM embeddings and the test needs no LLM call (the LLM clustering has its own test).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.models.registry import MINILM, SMOLLM2, load_sentence_encoder
from overstory.retrieval.lattice.insert import insert_leaf, overfull_nodes, split_overfull
from overstory.retrieval.lattice.keywords import fallback_keywords
from overstory.retrieval.lattice.scorers import LLMSlateScorer, OracleSlateScorer, SlateScore
from overstory.retrieval.lattice.search import SearchConfig, search
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hotpot_tree():
    documents, questions = load_corpus(CorpusConfig(kind="hotpotqa", path=str(ROOT / "data" / "hotpotqa")))
    leaves = [Node(id=d.id, leaf=True, text=f"{d.title}: {d.text}", doc_id=d.id) for d in documents]
    encoder = load_sentence_encoder(MINILM)
    builder = TopDownBuilder(client=None, embed=lambda texts: encoder.encode(texts, batch_size=64), m_max=10,
                             token_budget=0)
    tree = builder.build(leaves, {leaf.id: fallback_keywords(leaf.text) for leaf in leaves})
    tree.validate(max_branching=10, expected_leaves={leaf.id for leaf in leaves})
    gold = {q.id: set(q.gold_doc_ids) for q in questions}
    return tree, questions, gold, builder


def recall_at(results, gold, k):
    return float(np.mean([len({n for n, _ in r.ranking[:k]} & gold[r.query_id]) / len(gold[r.query_id])
                          for r in results]))


def test_kmeans_splits_are_counted(hotpot_tree):
    tree, _, _, builder = hotpot_tree
    assert builder.stats.llm_calls == 0 and builder.stats.placements["no_level_kmeans"] > 0
    assert tree.stats()["depth"] >= 3  # 400 leaves under nodes of at most 10 children


@pytest.mark.parametrize("calibration", [True, False])
def test_oracle_search_reaches_the_gold(hotpot_tree, calibration):
    tree, questions, gold, _ = hotpot_tree
    results = search(tree, [(q.id, q.question) for q in questions], OracleSlateScorer(tree, gold),
                     SearchConfig(calibration=calibration))
    assert recall_at(results, gold, 10) >= 0.95
    first = results[0]
    assert first.slates[0].expanded == tree.root and len(first.slates) <= 1 + 2 * 19
    assert all(r.ranking and all(tree.nodes[n].leaf for n, _ in r.ranking) for r in results)


class PartialScorer:
    """Stands in for an LLM whose replies leave candidates out and fail outright now and then (a real tiny model
    does not do either on demand): scores every other candidate by the oracle, and fails every fifth slate."""

    listwise = True

    def __init__(self, oracle):
        self.oracle, self.calls = oracle, 0

    def score(self, slates):
        out = []
        for slate, full in zip(slates, self.oracle.score(slates), strict=True):
            self.calls += 1
            if self.calls % 5 == 0:
                out.append(SlateScore(scores={}, raw="not json", parsed=False, problems={"missing": len(slate.texts)}))
            else:
                kept = {i: s for i, s in full.scores.items() if i % 2 == 0}
                out.append(SlateScore(scores=kept, problems={"missing": len(full.scores) - len(kept)}))
        return out


def test_damaged_replies_are_counted_and_the_search_goes_on(hotpot_tree):
    tree, questions, gold, _ = hotpot_tree
    results = search(tree, [(q.id, q.question) for q in questions[:10]], PartialScorer(OracleSlateScorer(tree, gold)))
    assert sum(r.failed_slates for r in results) > 0
    assert all(r.problems["missing"] > 0 and r.problems["unscored_candidates"] > 0 for r in results)
    failed = next(s for r in results for s in r.slates if not s.parsed)
    assert failed.raw_reply == "not json" and all(v is None for v in failed.raw_scores)
    assert all(r.ranking for r in results)  # the valid half of every slate still leads somewhere


def test_slates_carry_calibration_nodes_and_refitted_latent_scores(hotpot_tree):
    tree, questions, gold, _ = hotpot_tree
    [result] = search(tree, [(questions[0].id, questions[0].question)], OracleSlateScorer(tree, gold),
                      SearchConfig(iterations=8))
    leaf_slates = [s for s in result.slates if s.leaf and s.calibration_ids]
    inner_slates = [s for s in result.slates if not s.leaf and s.calibration_ids]
    assert leaf_slates and inner_slates
    for slate in result.slates:
        assert len(slate.latent_scores) == len(slate.node_ids)
        assert not set(slate.calibration_ids) & set(tree.node(slate.expanded).children)
    assert all(len(s.calibration_ids) <= 10 for s in leaf_slates) and all(len(s.calibration_ids) == 1
                                                                          for s in inner_slates)


@pytest.mark.slow
def test_search_with_the_real_built_in_scorer(hotpot_tree, engines):
    tree, questions, gold, _ = hotpot_tree
    engine = engines(ServeConfig(port=0, roles={"scorer": RoleConfig(model=SMOLLM2)}))
    scorer = LLMSlateScorer(in_process_client(engine), max_tokens=160, max_candidate_chars=160,
                            max_reasoning_chars=160)
    results = search(tree, [(q.id, q.question) for q in questions[:1]], scorer, SearchConfig(iterations=2, beam=1))
    for result in results:
        assert len(result.slates) == 2  # the root, then the best of its children
        assert result.llm_calls >= len(result.slates) and result.input_tokens > 0 and result.output_tokens > 0
        assert result.scorer_seconds > 0 and result.seconds > 0
        parsed = [s for s in result.slates if s.parsed]
        assert all(s.raw_reply for s in result.slates)
        assert all(any(v is not None for v in s.raw_scores) for s in parsed)
    assert any(s.parsed for r in results for s in r.slates)  # grammar-constrained JSON parses


def test_insert_places_a_leaf_by_search_and_splits_an_overfull_cluster(hotpot_tree):
    tree = copy.deepcopy(hotpot_tree[0])  # the fixture's tree is shared with the other tests
    cluster = next(n for n in tree.nodes.values() if not n.leaf and all(tree.nodes[c].leaf for c in n.children)
                   and len(n.children) >= 2)
    sibling = cluster.children[0]
    # the oracle's gold for the new leaf is a leaf of that cluster: the search must reach it, and the leaf joins it
    new = Node(id="new-doc", leaf=True, text=tree.nodes[sibling].text, doc_id="new-doc")
    scorer = OracleSlateScorer(tree, {"insert:new-doc": {sibling}})
    assert insert_leaf(tree, new, scorer) == cluster.id and tree.parent("new-doc") == cluster.id
    tree.validate(max_branching=None)
    # fill the cluster past M = 10, then split it in place: every leaf stays, the bound holds again
    for i in range(11 - len(cluster.children)):
        tree.add_child(cluster.id, Node(id=f"extra-{i}", leaf=True, text=f"{tree.nodes[sibling].text} ({i})"))
    assert overfull_nodes(tree, 10) == [cluster.id]
    leaves_before = {n.id for n in tree.leaves()}
    encoder = load_sentence_encoder(MINILM)
    splitter = TopDownBuilder(client=None, embed=lambda texts: encoder.encode(texts), m_max=10, token_budget=0,
                              id_prefix="split-")
    assert split_overfull(tree, [cluster.id], splitter, {}) >= 1  # k-means groups of 2+ become new clusters
    tree.validate(max_branching=10, expected_leaves=leaves_before)
    assert overfull_nodes(tree, 10) == []
