"""LATTICE's search over a tree of the shipped HotpotQA sample: the oracle reaches the gold (the tree and the
search lose no gold leaf), damaged replies keep their valid scores, and the real built-in model drives it end to end.
A reply cut by max_tokens keeps its complete scores and is counted; a slate prompt longer than the served context is
refused before sending, failed and counted.
Over a five-node tree with known scores: path relevance by hand, and where an unscored candidate ranks. A request the
server refuses raises; one that fails for a transient reason is a failed slate marked for a rerun.

The tree here is built top-down with ``token_budget=0``: no summary level fits, so every split is k-means on
the real MiniLM embeddings and the test needs no LLM call (the LLM clustering has its own test).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.evaluation.repairs import is_repair, repair_counts
from overstory.models.registry import MINILM, SMOLLM2, load_sentence_encoder
from overstory.retrieval.lattice.calibration import Observation, fit_latent_scores
from overstory.retrieval.lattice.insert import insert_leaf, overfull_nodes, split_overfull
from overstory.retrieval.lattice.keywords import fallback_keywords
from overstory.retrieval.lattice.scorers import (
    CrossEncoderSlateScorer,
    LLMSlateScorer,
    OracleSlateScorer,
    Slate,
    SlateScore,
)
from overstory.retrieval.lattice.search import SearchConfig, search
from overstory.retrieval.lattice.top_down import TopDownBuilder
from overstory.retrieval.lattice.tree import Node, Tree
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.client import Client, ClientError
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


# ------------------------------------------------------------------------------ path relevance, by hand


def small_tree() -> Tree:
    """root -> A -> (a1, a2), root -> B -> (b1, b2)."""
    nodes = {"root": Node("root", children=["A", "B"]), "A": Node("A", name="A", children=["a1", "a2"]),
             "B": Node("B", name="B", children=["b1", "b2"])}
    nodes.update({leaf: Node(leaf, leaf=True, text=leaf) for leaf in ("a1", "a2", "b1", "b2")})
    return Tree("root", nodes)


class TableScorer:
    """Stands in for a listwise LLM with known scores (a real model gives no chosen score on demand): a slate's
    candidate gets ``TABLE[(the slate's first node, candidate)]``, and a candidate without an entry is left out of
    the reply, as a damaged reply leaves one out. The same leaf a1 gets 60 in its own slate and 90 as B's
    calibration leaf: the slate bias that calibration removes."""

    listwise = True
    TABLE = {("A", "A"): 80, ("A", "B"): 0, ("a1", "a1"): 60, ("b1", "b1"): 0, ("b1", "b2"): 100, ("b1", "a1"): 90}

    def score(self, slates):
        return [SlateScore(scores={i: self.TABLE[(s.node_ids[0], n)] for i, n in enumerate(s.node_ids)
                                   if (s.node_ids[0], n) in self.TABLE}) for s in slates]


@pytest.mark.parametrize("calibration", [True, False])
def test_path_relevance_by_hand_and_an_unscored_candidate_ranks_last(calibration):
    """p(v) = alpha * p(parent) + (1 - alpha) * s_hat(v), p(root) = 1, with s_hat the calibrated fit of every score
    (or each node's mean raw score without calibration). a2, left out of its slate's reply, has relevance 0 and ranks
    after every scored leaf, even after b1, whose calibrated path relevance is below 0 (its slate is biased up by
    0.3 through a1, and B scored 0), and it is no calibration leaf for B's slate."""
    alpha = 0.2
    [result] = search(small_tree(), [("q", "query")], TableScorer(),
                      SearchConfig(beam=1, iterations=3, alpha=alpha, calibration=calibration))
    assert [(s.expanded, s.node_ids) for s in result.slates] == [
        ("root", ["A", "B"]), ("A", ["a1", "a2"]), ("B", ["b1", "b2", "a1"] if calibration else ["b1", "b2"])]
    observed = [Observation(s.slate_id, n, v / 100) for s in result.slates for n, v in zip(s.node_ids, s.raw_scores)
                if v is not None]
    if calibration:
        s_hat = fit_latent_scores(observed, SearchConfig().bias_ridge).node_scores
    else:
        s_hat = {n: float(np.mean([o.score for o in observed if o.node == n])) for n in {o.node for o in observed}}
    assert "a2" not in s_hat and s_hat["a1"] == pytest.approx(0.75 if calibration else 0.6)
    p = {"A": alpha + (1 - alpha) * s_hat["A"], "B": alpha + (1 - alpha) * s_hat["B"]}
    p.update({leaf: alpha * p[leaf[0].upper()] + (1 - alpha) * s_hat[leaf] for leaf in ("a1", "b1", "b2")})
    expected = sorted(["a1", "b1", "b2"], key=lambda n: -p[n])
    assert [n for n, _ in result.ranking] == [*expected, "a2"]
    assert [v for _, v in result.ranking] == pytest.approx([*(p[n] for n in expected), 0.0])
    if calibration:
        assert p["b1"] < 0 and s_hat["b1"] == pytest.approx(-0.1485, abs=1e-4)
    assert result.slates[1].latent_scores[1] is None and result.problems["unscored_candidates"] == 1


# ------------------------------------------------------------------------------ failed requests


class FailingServer:
    """Stands in for the server's chat and score endpoints (the ``Backend`` of serving/client.py): every request
    raises the next of ``errors``, then each gets an unusable reply. A real engine cannot be made to time out, be
    overloaded or throttle on demand."""

    def __init__(self, *errors: ClientError):
        self.errors, self.requests = list(errors), 0

    def post(self, path, payload):
        self.requests += 1
        if self.errors:
            raise self.errors.pop(0)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "not json"},
                             "finish_reason": "stop"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}, 0

    def get(self, path):
        return [{}]

    def close(self):
        pass


def test_a_refused_scorer_request_raises(engines):
    """A real engine that serves no ``scorer`` role refuses the slate with a 404: every slate would fail the same
    way, so the search raises instead of ranking from zero scores."""
    engine = engines(ServeConfig(port=0, roles={"embedder": RoleConfig(model=MINILM, kind="embedding")}))
    client = in_process_client(engine)
    for scorer in (LLMSlateScorer(client), CrossEncoderSlateScorer(client)):
        with pytest.raises(RequestRefused, match=r"role 'scorer'.*404") as refused:
            search(small_tree(), [("q", "query")], scorer, SearchConfig(iterations=2))
        assert refused.value.status == 404 and isinstance(refused.value.__cause__, ClientError)
    with pytest.raises(RequestRefused, match="400"):  # a bad request, from a stand-in server
        search(small_tree(), [("q", "query")], LLMSlateScorer(Client(FailingServer(ClientError(400, "bad")))))


@pytest.mark.parametrize("errors, failure", [
    ((ClientError(503, "busy"),), ""),  # the second try got a reply: not a request failure (the reply is unusable)
    ((ClientError(0, "ReadTimeout"), ClientError(429, "slow down")), "429: slow down"),
    ((ClientError(408, "request timeout"), ClientError(502, "bad gateway")), "502: bad gateway")])
def test_a_transient_request_failure_is_a_failed_slate_marked_for_a_rerun(errors, failure):
    server = FailingServer(*errors)
    [result] = search(small_tree(), [("q", "query")], LLMSlateScorer(Client(server), max_attempts=2),
                      SearchConfig(iterations=1))
    [slate] = result.slates
    assert server.requests == 2 and result.failed_slates == 1 and not slate.parsed
    assert slate.failure == failure
    assert slate.raw_reply == (f"<request failed: {failure}>" if failure else "not json")


# ------------------------------------------------------------------------------ replies cut short, prompts too long


class TruncatingServer:
    """Stands in for a chat server whose slate reply is cut by ``max_tokens`` (finish_reason "length") after
    ``reply``: a real model cannot be made to stop at a chosen place in its JSON on cue. It lists a 2,048-token
    context and counts every prompt as 50 tokens, so the length check lets the slate through."""

    def __init__(self, reply: str):
        self.reply, self.paths = reply, []

    def post(self, path, payload):
        self.paths.append(path)
        if path == "/tokenize":
            return {"count": 50, "max_model_len": 2048, "tokens": [0] * 50, "token_strs": None}, 0
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": self.reply},
                             "finish_reason": "length"}], "usage": {"prompt_tokens": 50, "completion_tokens": 9}}, 0

    def get(self, path):
        return [{"object": "list", "data": [{"id": "scorer", "object": "model", "max_model_len": 2048}]}]

    def close(self):
        pass


def test_a_truncated_reply_keeps_its_parsed_scores_and_is_counted():
    """The root's slate (A, B) gets a reply cut inside its scores: A's complete pair is kept, B is missing (unscored),
    the slate is not asked again (it would be cut at the same place), and the truncation is counted among the
    repairs eval lattice shows. A reply cut before any score is asked again, then kept as a failed slate."""
    server = TruncatingServer('{"reasoning": "A fits", "ranking": [0, 1], "relevance_scores": [[0, 80], [1, 1')
    [result] = search(small_tree(), [("q", "query")], LLMSlateScorer(Client(server), max_attempts=2),
                      SearchConfig(iterations=1))
    [slate] = result.slates
    assert slate.parsed and slate.raw_scores == [80.0, None] and slate.reasoning == "A fits"
    assert server.paths == ["/tokenize", "/v1/chat/completions"] and result.llm_calls == 1
    assert result.problems["reply_truncated"] == 1 and result.problems["missing"] == 1
    assert repair_counts([result.problems]) == {"reply_truncated": 1, "missing": 1, "unscored_candidates": 1}
    cut_early = TruncatingServer('{"reasoning": "A fi')
    [result] = search(small_tree(), [("q", "query")], LLMSlateScorer(Client(cut_early), max_attempts=2),
                      SearchConfig(iterations=1))
    assert result.failed_slates == 1 and result.llm_calls == 2 and result.problems["reply_truncated"] == 2
    assert result.slates[0].failure == ""  # the server answered: no request failure to ask again on a rerun


class LoraServer(TruncatingServer):
    """The same stand-in listing the scorer as vLLM lists a LoRA module: without a context of its own, under a base
    model whose context is 96 tokens, so a 50-token prompt and 48 completion tokens do not fit."""

    def get(self, path):
        return [{"object": "list", "data": [{"id": "scorer", "object": "model", "parent": "base"},
                                            {"id": "base", "object": "model", "max_model_len": 96}]}]


def test_a_lora_scorer_is_checked_against_its_base_models_context():
    server = LoraServer("unused")
    [result] = search(small_tree(), [("q", "query")], LLMSlateScorer(Client(server), max_tokens=48),
                      SearchConfig(iterations=1))
    assert server.paths == ["/tokenize"] and result.llm_calls == 0  # counted, never sent
    assert result.failed_slates == 1 and result.problems["prompt_too_long_failed"] == 1
    assert "96-token context" in result.slates[0].raw_reply


@pytest.mark.slow
def test_a_slate_prompt_longer_than_the_context_is_refused_before_sending(engines):
    """SmolLM2 served with a 320-token context: a slate of three real HotpotQA paragraphs does not fit with its
    completion and is not sent (no chat request reaches the engine), but failed and counted; a short slate in the
    same batch is sent and answered."""
    documents, questions = load_corpus(CorpusConfig(kind="hotpotqa", path=str(ROOT / "data" / "hotpotqa")))
    paragraphs = {d.id: f"{d.title}: {d.text}" for d in documents}
    question = questions[0]
    long_texts = [paragraphs[i] for i in question.gold_doc_ids] + [paragraphs[documents[0].id]]
    engine = engines(ServeConfig(port=0, roles={"scorer": RoleConfig(model=SMOLLM2, max_model_len=320)}))
    client = in_process_client(engine)
    scorer = LLMSlateScorer(client, max_tokens=48, max_candidate_chars=600, max_reasoning_chars=20, max_attempts=1)
    too_long = Slate(question.id, question.question, ["a", "b", "c"], long_texts, True)
    short = Slate(question.id, question.question, ["a", "b"], ["Barnaby Joyce.", "Bananas."], True)
    refused, sent = scorer.score([too_long, short])
    assert refused.calls == 0 and not refused.parsed and refused.scores == {} and refused.failure == ""
    assert refused.problems == {"missing": 3, "prompt_too_long_failed": 1} and "320-token context" in refused.raw
    assert sent.calls == 1 and sent.input_tokens > 0  # a slate that fits is sent as before
    assert client.stats.summary()["scorer"]["requests"] == 1  # only the short slate's chat request
    assert is_repair("prompt_too_long_failed") and is_repair("reply_truncated")
