"""LATTICE's index that persists and updates: removal merges a cluster left with one child (by hand, on small trees),
and through ``Retriever`` on real HotpotQA paragraphs (MiniLM clusters the tree through the served embedder, a served
cross-encoder scores the search-and-insert): a saved tree loads as it was, an added document's leaves are placed by
search-and-insert and found, a cluster pushed past M is split, and removing the document leaves every saved file as
before when no split happened. The scorer is MiniLM with an untrained one-label head
(tests/serving/cross_encoder_fixture.py): these tests check where the updates put things and what they leave, not
ranking quality; the LLM scorer's slates are the search tests' (tests/retrieval/test_lattice_search.py). With SmolLM2
scoring the slates these two tests took about 230 s; with the cross-encoder, seconds."""

from __future__ import annotations

import pytest

from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.evaluation.pipeline import DATASETS
from overstory.models.registry import MINILM
from overstory.retrieval.api import Models, Retriever
from overstory.retrieval.index_manifest import current_version
from overstory.retrieval.lattice.insert import leaf_node, remove_leaves
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree, TreeError
from overstory.serving.config import RoleConfig, ServeConfig
from tests.serving.cross_encoder_fixture import build_tiny_cross_encoder

SETTINGS = HierarchyConfig()
# depth-2 trees: two iterations of one slate reach every leaf
CONFIG = {"scorer": "cross_encoder", "search": {"iterations": 2, "beam": 1, "calibration_leaves": 2}}


def hand_tree() -> Tree:
    """root -> A (a1, a2), B (b1, b2, b3)."""
    nodes = {"root": Node("root", children=["A", "B"]), "A": Node("A", name="A", children=["a1", "a2"]),
             "B": Node("B", name="B", children=["b1", "b2", "b3"])}
    nodes.update({i: Node(i, leaf=True, text=i, doc_id=f"d-{i}") for i in ("a1", "a2", "b1", "b2", "b3")})
    return Tree("root", nodes)


def test_removing_leaves_merges_a_cluster_left_with_one_child_and_changes_nothing_else() -> None:
    tree = hand_tree()
    assert remove_leaves(tree, ["a1"]) == 1  # A is left with a2 alone: a2 takes its place under the root
    assert tree.nodes["root"].children == ["a2", "B"] and "A" not in tree.nodes and tree.parent("a2") == "root"
    assert tree.nodes["B"].children == ["b1", "b2", "b3"]
    assert remove_leaves(tree, ["b1"]) == 0 and tree.nodes["B"].children == ["b2", "b3"]
    tree.validate(expected_leaves={"a2", "b2", "b3"})
    assert remove_leaves(tree, ["a2"]) == 1  # the root is left with cluster B alone: B becomes the root
    assert tree.root == "B" and set(tree.nodes) == {"B", "b2", "b3"}
    with pytest.raises(TreeError, match="empty"):
        remove_leaves(tree, ["b2", "b3"])
    with pytest.raises(TreeError, match="not leaves"):
        remove_leaves(tree, ["B"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    scorer = build_tiny_cross_encoder(tmp_path_factory.mktemp("scorer") / "ce")
    serve = ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding"),
                                       "scorer": RoleConfig(model=scorer, kind="cross-encoder")})
    with Models.builtin(serve) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def corpus():
    """(A's documents and hierarchy, B's, the question B answers): B is the sample's first question's gold pair, A
    eight other documents."""
    documents, questions = load_corpus(DATASETS["hotpotqa"])
    question = questions[0]
    a_docs = [d for d in documents if d.id not in question.gold_doc_ids][:8]
    b_docs = [d for d in documents if d.id in question.gold_doc_ids]
    return a_docs, build_hierarchies(a_docs, SETTINGS), b_docs, build_hierarchies(b_docs, SETTINGS), question


def _tree(models, chunks, folder, m_max: int, limit: int | None = None) -> str:
    """A k-means tree (MiniLM through the served embedder) over the paragraphs of ``chunks`` (the first ``limit``),
    at most ``m_max`` children a node, saved in ``folder``."""
    leaves = [leaf_node(c) for c in chunks if c.level == "paragraph"][:limit]
    builder = TopDownBuilder(None, lambda texts: models.client.embed("embedder", texts), m_max=m_max, token_budget=0)
    return str(builder.build(leaves, {}).save(folder / "tree.json"))


def _files(folder) -> dict[str, bytes]:
    version = current_version(folder)
    return {str(p.relative_to(version)): p.read_bytes() for p in sorted(version.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_lattice_index_loads_adds_by_search_and_insert_and_removes(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, question = corpus
    tree_path = _tree(models, a_chunks, tmp_path, m_max=10)
    retriever = Retriever.build("lattice", a_docs, a_chunks, models, config={**CONFIG, "tree": tree_path},
                                settings=SETTINGS)
    retriever.save(tmp_path / "before")
    before = _files(tmp_path / "before")
    loaded = Retriever.load(tmp_path / "before", models, settings=SETTINGS)
    assert loaded.strategy.tree.nodes == retriever.strategy.tree.nodes and loaded.doc_ids == retriever.doc_ids
    assert [h.id for h in loaded.retrieve(question.question, k=3).evidence] == \
        [h.id for h in retriever.retrieve(question.question, k=3).evidence]

    retriever.add_documents(b_docs, b_chunks)
    tree = retriever.strategy.tree
    b_leaves = {c.id for c in b_chunks if c.level == "paragraph"}
    a_leaves = {c.id for c in a_chunks if c.level == "paragraph"}
    tree.validate(max_branching=10, expected_leaves=a_leaves | b_leaves)
    assert before["index/tree.json"] == _files(tmp_path / "before")["index/tree.json"]  # the old tree is untouched
    found = retriever.retrieve(question.question, k=5, scope=[d.id for d in b_docs])
    assert found.evidence and {h.id for h in found.evidence} <= b_leaves

    retriever.remove_documents([d.id for d in b_docs])
    retriever.save(tmp_path / "after")
    after = _files(tmp_path / "after")
    assert sorted(after) == sorted(before) and all(after[p] == before[p] for p in before)


@pytest.mark.slow
def test_an_insert_past_m_splits_the_cluster_and_a_removal_merges_back(models, corpus, tmp_path) -> None:
    a_docs, a_chunks, b_docs, b_chunks, _ = corpus
    # three leaves under the root and M = 3: the root is full, so any insert pushes it past M
    tree_path = _tree(models, a_chunks, tmp_path, m_max=3, limit=3)
    retriever = Retriever.build("lattice", a_docs, a_chunks, models, config={**CONFIG, "tree": tree_path})
    before = retriever.strategy.tree
    a_leaves = {n.id for n in before.leaves()}
    assert len(before.nodes[before.root].children) == 3
    retriever.add_documents(b_docs, b_chunks)
    grown = retriever.strategy.tree
    b_leaves = {c.id for c in b_chunks if c.level == "paragraph"}
    grown.validate(max_branching=3, expected_leaves=a_leaves | b_leaves)  # the overfull root was split
    assert any(i.startswith("split") for i in grown.nodes) and before.validate(max_branching=3) is None
    retriever.remove_documents([d.id for d in b_docs])
    shrunk = retriever.strategy.tree
    shrunk.validate(max_branching=3, expected_leaves=a_leaves)
    assert all(len(n.children) >= 2 for n in shrunk.nodes.values() if not n.leaf and n.id != shrunk.root)
