"""FABLE: TreeExpansion, greedy selection, NodeFusion and budget control on hand-checked trees; the forest builder's
chunking, grouping, structure seeding and fallbacks and the strategy's modes against a scripted stand-in server; and
the real built-in tiny models building a forest and answering a HotpotQA question end to end."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Document, Span
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.models.registry import MINILM, SMOLLM2
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.fable.builder import ForestBuilder, ForestConfig
from overstory.retrieval.fable.forest import Forest, ForestNode
from overstory.retrieval.fable.paths import budget_prefix, greedy_select, node_fusion, tree_expansion_scores
from overstory.retrieval.fable.replies import parse_ids, parse_summary
from overstory.retrieval.fable.runs import parse_starts
from overstory.retrieval.fable.strategy import MODES, FableConfig, FableStrategy
from overstory.retrieval.metrics import recall_at_k
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = [
    Document("t/rivers", "Rivers", "The Nile is the longest river. The Nile runs through Egypt.\n\n"
                                   "Rivers flow to the sea. Rivers carry water."),
    Document("t/cities", "Cities", "Paris is the capital of France. Paris has the Eiffel Tower."),
    Document("t/alps", "Alps", "The Alps are mountains in Europe. Mont Blanc is the highest of the Alps."),
]
# the stand-in embeds a text as its counts of these words (plural -s ignored), plus a small constant
VOCAB = ("nile", "river", "longest", "egypt", "sea", "paris", "france", "capital", "tower", "alp", "mountain",
         "europe", "blanc")
DEFAULT_REPLIES = {"chunk_starts": '{"chunk_starts": [0]}', "group_starts": '{"group_starts": [0]}',
                   "node_summary": '{"title": "Topic", "summary": "What it covers."}', "selection": '{"ids": [0]}',
                   "answer": "The Nile"}


def embed(text: str) -> list[float]:
    words = [w.removesuffix("s") for w in re.findall(r"[a-z]+", text.lower())]
    return [0.01] + [float(words.count(v)) for v in VOCAB]


class StandIn:
    """Stands in for the served generator and embedder (the ``Backend`` of serving/client.py): a real tiny model
    cannot be made to emit a given malformed or out-of-range reply on demand, and exact similarities need known
    vectors. A chat request gets the next scripted reply for the schema it asks for (its response_format's name;
    "answer" without one), else that schema's default; an exception in a script is raised instead. Every request
    is kept. An embedding is ``embed(text)``; ``embed_error``, when set, is raised for embeddings instead."""

    def __init__(self, **scripts: list):
        self.scripts = {name: list(replies) for name, replies in scripts.items()}
        self.chats: list[tuple[str, dict]] = []
        self.embedded: list[str] = []
        self.embed_error: Exception | None = None

    def post(self, path, payload):
        if path == "/v1/embeddings":
            if self.embed_error is not None:
                raise self.embed_error
            self.embedded += payload["input"]
            data = [{"index": i, "embedding": embed(text)} for i, text in enumerate(payload["input"])]
            return {"data": data, "usage": {"prompt_tokens": 0, "total_tokens": 0}}, 0
        name = (payload.get("response_format") or {}).get("json_schema", {}).get("name", "answer")
        self.chats.append((name, copy.deepcopy(payload)))
        script = self.scripts.get(name)
        reply = script.pop(0) if script else DEFAULT_REPLIES[name]
        if isinstance(reply, Exception):
            raise reply
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}, 0

    def get(self, path):
        return [{}]

    def close(self):
        pass

    def prompts(self, name: str) -> list[str]:
        return [payload["messages"][-1]["content"] for kind, payload in self.chats if kind == name]


def hierarchy_of(*documents: Document):
    return build_hierarchies(documents, HierarchyConfig())


def build_tree(document: Document, backend: StandIn, **config):
    """One tree from the stand-in's replies; the model's chunks are kept as they are (these documents are a few
    tokens long) unless a test sets min_chunk_tokens."""
    config = {"min_chunk_tokens": 0, **config}
    return ForestBuilder(Client(backend), ForestConfig(**config)).build(document, hierarchy_of(document))


@pytest.fixture(scope="module")
def strategy():
    """The three documents; the rivers document is chunked into its two paragraphs (2 leaves), the others are one
    leaf each: every tree is a root over its leaves (the model's chunks kept as they are)."""
    backend = StandIn(chunk_starts=['{"chunk_starts": [0, 2]}'])
    return FableStrategy.build(DOCUMENTS, hierarchy_of(*DOCUMENTS), Client(backend),
                               forest=ForestConfig(min_chunk_tokens=0))


def with_config(strategy, **changes):
    return FableStrategy(strategy.forest, FableConfig(**changes), AnswerConfig())


# ------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("cls, key, value", [
    (FableConfig, "budget_tokens", 0), (FableConfig, "budget_tokens", -100), (FableConfig, "mode", "trees"),
    (FableConfig, "top_k", 0), (FableConfig, "llm_depth", 0), (ForestConfig, "depth", 1), (ForestConfig, "depth", 5),
    (ForestConfig, "min_chunk_tokens", -1), (ForestConfig, "min_chunk_tokens", 500),
    (ForestConfig, "max_children", 1), (ForestConfig, "group_window", 4), (ForestConfig, "chunk_tokens", 0)])
def test_configs_name_the_bad_key(cls, key, value):
    prefix = "fable" if cls is FableConfig else "forest"
    with pytest.raises(ConfigError, match=f"{prefix}.{key}"):
        cls(**{key: value})


# ---------------------------------------------------------------------- TreeExpansion, fusion and the budget

# A hand-made tree: root r (depth 1) > section a (depth 2) > leaves c, d (depth 3), and leaf b (depth 2) under r.
TEXT = "abcdefghij"
COSINE = {"r": 0.2, "a": 0.8, "b": 0.5, "c": 0.9, "d": 0.3}


def hand_forest() -> Forest:
    def node(i, kind, depth, parent, children, start, end, tokens):
        cos = COSINE[i]
        return ForestNode(i, "doc", kind, depth, parent, children, start, end, tokens,
                          embedding=[cos, math.sqrt(1 - cos * cos)])  # cosine with the query [1, 0] is COSINE[i]

    return Forest([Document("doc", "Doc", TEXT), Document("other", "Other", "xyz")], [
        node("r", "root", 1, None, ["a", "b"], 0, 10, 100), node("a", "section", 2, "r", ["c", "d"], 0, 6, 60),
        node("c", "leaf", 3, "a", [], 0, 3, 30), node("d", "leaf", 3, "a", [], 3, 6, 30),
        node("b", "leaf", 2, "r", [], 6, 10, 40),
        ForestNode("s", "other", "root", 1, None, [], 0, 3, 5, embedding=[0.0, 1.0])])


def test_tree_expansion_scores_match_the_hand_computation():
    forest = hand_forest()
    cosine = forest.similarities([1.0, 0.0])
    assert cosine == pytest.approx({**COSINE, "s": 0.0}, abs=1e-6)
    # S_sim = cos / depth:          r .2/1 = .2    a .8/2 = .4    b .5/2 = .25    c .9/3 = .3    d .3/3 = .1
    # S_inh = max S_sim of ancestors: r 0 (none)   a .2           b .2            c max(.2, .4) = .4   d .4
    # S_child = mean S of children:   leaves 0;    a mean(S(c), S(d));  r mean(S(a), S(b))
    # S(c) = (.3 + .4 + 0) / 3 = .233333      S(d) = (.1 + .4 + 0) / 3 = .166667    S(b) = (.25 + .2 + 0) / 3 = .15
    # S(a) = (.4 + .2 + (.233333 + .166667) / 2) / 3 = (.4 + .2 + .2) / 3 = .266667
    # S(r) = (.2 + 0 + (.266667 + .15) / 2) / 3 = (.2 + .208333) / 3 = .136111
    scores = tree_expansion_scores(forest, ["doc"], cosine)
    assert scores == pytest.approx({"c": 0.233333, "d": 0.166667, "b": 0.15, "a": 0.266667, "r": 0.136111}, abs=1e-6)


@pytest.mark.parametrize("budget, taken", [
    (70, ["a"]),  # a (60) first; c and d are under it; b (40) and r (100 - 60) no longer fit
    (100, ["r"]),  # a (60), then b (40): 100; r costs 100 - 60 - 40 = 0 more and replaces both (ancestors first)
    (50, ["c"]),  # a does not fit; c (30) does; d and b would pass 50
    (29, []),  # no node is that small
])
def test_greedy_selection_by_score_within_the_budget(budget, taken):
    forest = hand_forest()
    scores = tree_expansion_scores(forest, ["doc"], forest.similarities([1.0, 0.0]))
    assert greedy_select(forest, scores, budget) == taken


def test_node_fusion_drops_covered_nodes_and_orders_by_document_then_position():
    forest = hand_forest()
    assert node_fusion(forest, ["d", "a", "s", "c", "a"], ["other", "doc"]) == ["s", "a"]  # c, d are under a
    assert node_fusion(forest, ["b", "c", "s"], ["doc", "other"]) == ["c", "b", "s"]  # c at 0 before b at 6
    assert node_fusion(forest, ["s", "b", "r"], ["doc"]) == ["r", "s"]  # a document not in the order goes last


@pytest.mark.parametrize("tokens, budget, kept", [
    ([50, 30, 40], 85, 2), ([50, 30, 40], 120, 3), ([50, 40, 10], 60, 1), ([90, 10], 60, 0), ([], 10, 0)])
def test_budget_control_keeps_a_prefix(tokens, budget, kept):
    assert budget_prefix(tokens, budget) == kept


@pytest.mark.parametrize("text, n, expected", [
    ('{"chunk_starts": [0, 2, 4]}', 5, ([0, 2, 4], 0)),
    ('Here: {"chunk_starts": [4, "2", 2, 9, -1]}', 5, ([0, 2, 4], 2)),  # 0 added, 9 and -1 out of range
    ("{'chunk_starts': [1,]}", 5, ([0, 1], 0)),  # single quotes and a trailing comma
    ('{"chunk_starts": 3}', 5, ([0, 3], 0)),  # a bare number for a list
    ('{"chunk_starts": []}', 5, None),  # an empty chunking
    ('{"chunk_starts": [7, 8]}', 5, None),  # nothing in range
    ('{"starts": [1]}', 5, None), ("sentences 0 and 2", 5, None),
])
def test_chunking_replies_parse_or_are_unusable(text, n, expected):
    assert parse_starts(text, "chunk_starts", n) == expected


def test_selection_and_summary_replies():
    assert parse_ids('{"ids": [3, "1", "[2]", 3, 12, "doc"]}', "ids", 4) == ([3, 1, 2], 2)  # 12, "doc" dropped
    assert parse_ids('{"ids": []}', "ids", 4) == ([], 0) and parse_ids("[1, 2]", "ids", 4) is None
    assert parse_summary('x {"title": "A"} {"title": " Nile  river ", "summary": "Longest."}') == ("Nile river",
                                                                                                   "Longest.")
    assert parse_summary('{"title": "A", "summary": "  "}') is None


# ---------------------------------------------------------------------------------------- building trees


def test_chunking_maps_sentence_numbers_to_exact_offsets():
    backend = StandIn(chunk_starts=['{"chunk_starts": [2, 0]}'], node_summary=['{"title": "T", "summary": "S."}'])
    tree = build_tree(DOCUMENTS[0], backend)
    nodes = {n.id: n for n in tree.nodes}
    root, *leaves = tree.nodes
    text = DOCUMENTS[0].text
    assert [text[n.start:n.end] for n in leaves] == ["The Nile is the longest river. The Nile runs through Egypt.",
                                                     "Rivers flow to the sea. Rivers carry water."]
    assert root.kind == "root" and root.children == [n.id for n in leaves] and (root.start, root.end) == (0, len(text))
    assert root.title == "Rivers" and root.summary == "S." and root.source == "llm"  # the document's title is kept
    assert root.n_tokens == sum(n.n_tokens for n in leaves) and all(n.depth == 2 for n in leaves)
    assert nodes["t/rivers#leaf1"].parent == "t/rivers#root" and all(n.source == "llm" for n in leaves)
    (prompt,) = backend.prompts("chunk_starts")
    assert "[0] The Nile is the longest river.\n[1] The Nile runs through Egypt.\n[2] Rivers flow" in prompt
    schema = backend.chats[0][1]["response_format"]["json_schema"]["schema"]["properties"]["chunk_starts"]
    assert schema["items"]["maximum"] == 3 and schema["maxItems"] == 4
    # internal nodes embed "toc path: summary", leaves their content
    assert backend.embedded == ["Rivers: S.", *(text[n.start:n.end] for n in leaves)]
    assert root.embedding == embed("Rivers: S.")
    assert tree.stats["chunk_calls"] == 1 and tree.stats["summary_calls"] == 1 and not tree.failures


@pytest.mark.parametrize("reply", ["no json at all", '{"chunk_starts": []}', '{"chunk_starts": [7, 9]}',
                                   ClientError(500, "engine crashed")])
def test_an_unusable_chunking_falls_back_to_paragraphs(reply):
    tree = build_tree(DOCUMENTS[0], StandIn(chunk_starts=[reply]))
    leaves = [n for n in tree.nodes if n.kind == "leaf"]
    text = DOCUMENTS[0].text
    # each paragraph (well under chunk_tokens) is one chunk
    assert [text[n.start:n.end] for n in leaves] == text.split("\n\n")
    assert all(n.source == "fallback" for n in leaves) and tree.stats["chunk_fallbacks"] == 1
    (failure,) = tree.failures
    assert failure.id == "t/rivers#root/chunk0" and failure.job == "fable forest"
    if isinstance(reply, Exception):
        assert failure.raw.startswith("<request failed") and tree.stats["request_failures"] == 1
    else:
        assert failure.raw == reply


@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_refused_forest_request_raises_naming_the_role(status):
    """A 4xx would fail every document alike: the builder raises instead of falling back (the data job stops);
    a transient embedding failure raises its ClientError (the job lists the document for a rerun)."""
    refused = StandIn(chunk_starts=[ClientError(status, "no model named 'generator'")])
    with pytest.raises(RequestRefused, match=rf"FABLE's forest chunk request \(role 'generator'\): .*no model "
                                             rf"named 'generator' \(HTTP {status}\)"):
        build_tree(DOCUMENTS[0], refused)
    assert [name for name, _ in refused.chats] == ["chunk_starts"]  # nothing asked after the refusal
    backend = StandIn()
    backend.embed_error = ClientError(status, "no model named 'embedder'")
    with pytest.raises(RequestRefused, match=rf"FABLE's forest embeddings \(role 'embedder'\).*HTTP {status}"):
        build_tree(DOCUMENTS[0], backend)
    backend.embed_error = ClientError(503, "busy")
    with pytest.raises(ClientError, match="503: busy"):
        build_tree(DOCUMENTS[0], backend)


def test_long_chunks_are_repacked_and_out_of_range_numbers_counted():
    tree = build_tree(DOCUMENTS[0], StandIn(chunk_starts=['{"chunk_starts": [0, 9]}']), max_chunk_tokens=12,
                      chunk_tokens=12)
    leaves = [n for n in tree.nodes if n.kind == "leaf"]
    assert tree.stats["chunk_ids_dropped"] == 1 and tree.stats["chunk_runs_split"] == 1
    # the one run (sentences of 7, 6, 7 and 5 tokens) re-packed up to 12 tokens
    assert [DOCUMENTS[0].text[n.start:n.end] for n in leaves] == [
        "The Nile is the longest river.", "The Nile runs through Egypt.", "Rivers flow to the sea. Rivers carry water."]
    assert [n.n_tokens for n in leaves] == [7, 6, 12] and not tree.failures


LONG = Document("t/facts", "Facts", "\n\n".join(f"Fact number {i} is about the topic {i}." for i in range(12)))
EACH_SENTENCE = json.dumps({"chunk_starts": list(range(12))})


def test_a_long_document_is_grouped_in_parts_and_the_parts_merged():
    """Depth 3, at most 3 children, 6 leaves per grouping prompt: two parts. Part one's reply [0, 2] gives runs
    0-1 and 2-5, the second over 3 and re-packed into 2-4 and 5; part two's reply is unusable: packs of 3."""
    backend = StandIn(chunk_starts=[EACH_SENTENCE], group_starts=['{"group_starts": [0, 2]}', "none"])
    tree = build_tree(LONG, backend, depth=3, max_children=3, group_window=6)
    nodes = {n.id: n for n in tree.nodes}
    root = nodes["t/facts#root"]
    leaf_numbers = [[int(c.removeprefix("t/facts#leaf")) for c in nodes[s].children] for s in root.children]
    assert leaf_numbers == [[0, 1], [2, 3, 4], [5], [6, 7, 8], [9, 10, 11]]
    assert all(nodes[s].kind == "section" and nodes[s].title == "Topic" for s in root.children)
    assert max(n.depth for n in tree.nodes) == 3
    assert (tree.stats["group_calls"], tree.stats["group_fallbacks"], tree.stats["group_runs_split"]) == (2, 1, 1)
    assert "[5] Fact number 5" in backend.prompts("group_starts")[0] and "[0] Fact number 6" in \
        backend.prompts("group_starts")[1]
    assert tree.stats["summary_calls"] == 6  # the root and 5 sections


def test_sentence_chunks_and_one_leaf_sections_are_merged():
    """The 135M model's habit, here from a stand-in: a chunk starts at every sentence (9 tokens each) and a section
    at every leaf. With min_chunk_tokens=20 the 12 one-sentence chunks (11 tokens, the last two 13) merge pairwise
    into 6 leaves; the 6 one-leaf sections (max_children 3) merge into 3 sections of 2 leaves."""
    each_leaf = json.dumps({"group_starts": list(range(6))})
    backend = StandIn(chunk_starts=[EACH_SENTENCE], group_starts=[each_leaf])
    tree = build_tree(LONG, backend, depth=3, max_children=3, min_chunk_tokens=20)
    nodes = {n.id: n for n in tree.nodes}
    leaves = [n for n in tree.nodes if n.kind == "leaf"]
    assert [n.n_tokens for n in leaves] == [22, 22, 22, 22, 22, 26]
    first = "Fact number 0 is about the topic 0.\n\nFact number 1 is about the topic 1."
    assert LONG.text[leaves[0].start:leaves[0].end] == first
    sections = [nodes[c] for c in nodes["t/facts#root"].children]
    assert [len(section.children) for section in sections] == [2, 2, 2]
    assert (tree.stats["chunk_runs_merged"], tree.stats["group_runs_merged"]) == (6, 3)


def test_depth_four_groups_sections_into_subsections():
    """At depth 4 a section may hold max_children^2 leaves (its subsections group them): the root's reply [0, 6]
    gives runs of 6, each over 4 and re-packed into 4 + 2; sections of 4 leaves get subsections: the first by the
    reply [0, 1] (1 + 3, the 3 re-packed into 2 + 1), the third by the fallback (2 + 2)."""
    backend = StandIn(chunk_starts=[EACH_SENTENCE],
                      group_starts=['{"group_starts": [0, 6]}', '{"group_starts": [0, 1]}', "none"])
    tree = build_tree(LONG, backend, depth=4, max_children=2, group_window=12)
    nodes = {n.id: n for n in tree.nodes}

    def shape(node_id):
        node = nodes[node_id]
        return int(node_id.removeprefix("t/facts#leaf")) if node.kind == "leaf" else [shape(c) for c in node.children]

    assert shape("t/facts#root") == [[[0], [1, 2], [3]], [4, 5], [[6, 7], [8, 9]], [10, 11]]
    assert max(n.depth for n in tree.nodes if n.kind == "leaf") == 4
    assert (tree.stats["group_calls"], tree.stats["group_fallbacks"], tree.stats["group_runs_split"]) == (3, 1, 3)
    for node in tree.nodes:  # an internal node spans its children exactly
        if node.children:
            assert (node.start, node.end) == (nodes[node.children[0]].start, nodes[node.children[-1]].end)
    # depth 2: the root holds every leaf, nothing is grouped
    flat = build_tree(LONG, StandIn(chunk_starts=[EACH_SENTENCE]), depth=2, max_children=2)
    assert len(flat.nodes) == 13 and flat.stats["group_calls"] == 0


@pytest.mark.parametrize("root_reply, fallbacks", [('{"group_starts": [0]}', 0), ("none", 1)])
def test_one_group_of_every_leaf_is_split_evenly(root_reply, fallbacks):
    """At depth 4 with max_children 4 a section may hold 16 leaves (its subsections group them), so the reply [0]
    (one section of all 12) passes every size check, as would packing an unusable reply: either way the root's 12
    leaves go into 3 even sections of 4, which need no subsections."""
    backend = StandIn(chunk_starts=[EACH_SENTENCE], group_starts=[root_reply])
    tree = build_tree(LONG, backend, depth=4, max_children=4)
    nodes = {n.id: n for n in tree.nodes}
    sections = [nodes[c] for c in nodes["t/facts#root"].children]
    assert [s.kind for s in sections] == ["section"] * 3
    assert [[int(c.removeprefix("t/facts#leaf")) for c in s.children] for s in sections] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert (tree.stats["group_calls"], tree.stats["group_fallbacks"]) == (1, fallbacks)
    assert tree.stats["group_runs_rebalanced"] == 1 - fallbacks


def headed_document() -> Document:
    """A QASPER-like paper: two sections, the second with two subsections, headings on lines of their own."""
    pieces = ["Introduction", "We study rivers. Rivers are long.", "Methods", "Nile", "We measured the Nile.",
              "Amazon", "We measured the Amazon. It is wide."]
    starts = [sum(len(p) + 2 for p in pieces[:i]) for i in range(len(pieces))]
    headings = [[1, "Introduction", starts[0], starts[0] + 12], [1, "Methods", starts[2], starts[2] + 7],
                [2, "Nile", starts[3], starts[3] + 4], [2, "Amazon", starts[5], starts[5] + 6]]
    paragraphs = [[starts[i], starts[i] + len(pieces[i])] for i in (1, 4, 6)]
    return Document("t/paper", "A paper", "\n\n".join(pieces), {"headings": headings, "paragraph_spans": paragraphs})


@pytest.mark.parametrize("depth, seed, chunkings, shape", [
    (4, True, ["[0]", "[0]"], {"Introduction": ["We study rivers. Rivers are long."],
               "Methods": {"Nile": ["We measured the Nile."], "Amazon": ["We measured the Amazon. It is wide."]}}),
    (3, True, ["[0]", "[0, 1]"], {"Introduction": ["We study rivers. Rivers are long."],
               "Methods": ["We measured the Nile.", "We measured the Amazon. It is wide."]}),
    (4, False, ["[0, 2, 3]"],
     ["We study rivers. Rivers are long.", "We measured the Nile.", "We measured the Amazon. It is wide."]),
])
def test_documents_with_headings_seed_their_sections(depth, seed, chunkings, shape):
    document = headed_document()
    backend = StandIn(chunk_starts=[f'{{"chunk_starts": {starts}}}' for starts in chunkings])
    tree = build_tree(document, backend, depth=depth, seed_structure=seed)
    nodes = {n.id: n for n in tree.nodes}

    def outline(node_id):
        node = nodes[node_id]
        if all(nodes[c].kind == "leaf" for c in node.children):
            return [document.text[nodes[c].start:nodes[c].end] for c in node.children]
        return {nodes[c].title: outline(c) for c in node.children}

    assert outline("t/paper#root") == shape
    assert tree.stats["seeded"] == int(seed) and tree.stats["group_calls"] == 0
    # a scope of one sentence (the Nile subsection) needs no chunking call
    assert tree.stats["chunk_calls"] == len(chunkings) and not backend.scripts["chunk_starts"]


def test_the_forest_saves_and_loads(strategy, tmp_path):
    forest = strategy.forest
    forest.save(tmp_path / "forest.json")
    loaded = Forest.load(tmp_path / "forest.json")
    assert loaded.records() == forest.records() and loaded.roots == forest.roots
    assert (loaded.matrix == forest.matrix).all()
    assert [n.kind for n in loaded.nodes.values()] == ["root", "leaf", "leaf", "root", "leaf", "root", "leaf"]
    chunk = loaded.chunk("t/rivers#leaf1")
    assert chunk.text == "Rivers flow to the sea. Rivers carry water." and chunk.level == "paragraph"
    assert DOCUMENTS[0].text[chunk.start:chunk.end] == chunk.text and chunk.title == "Rivers"
    assert loaded.chunk("t/rivers#root").level == "document"
    assert recall_at_k([chunk], [Span("t/rivers", chunk.start + 5, chunk.end)], 1) == 1.0
    (tmp_path / "bad.json").write_text(json.dumps({"format": "tree", "documents": []}))
    with pytest.raises(ValueError, match="not a fable-forest"):
        Forest.load(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------------------ retrieval

QUESTION = "Which river is the longest?"


@pytest.mark.parametrize("mode, route, selections", [
    ("fable", "documents", 1), ("llm-docs", "documents", 1), ("docs", "documents", 1),
    ("llm-nodes", "nodes", 2), ("treexp-nodes", "nodes", 1), ("nodes", "nodes", 2)])
def test_each_mode_runs(strategy, mode, route, selections):
    backend = StandIn(selection=['{"ids": [1]}', '{"ids": [0]}'])  # the document list: 0 rivers, 1 cities, 2 alps
    answer = with_config(strategy, mode=mode).answer(QUESTION, Client(backend))
    details = answer.details
    assert (answer.prediction, answer.failure) == ("The Nile", "")
    assert details["mode"] == mode and details["route"] == route and details["llm_documents"] == ["t/cities"]
    assert details["vector_documents"][0] == "t/rivers"  # "river", "longest" and "nile" are the rivers document's
    assert len(backend.prompts("selection")) == selections and len(backend.prompts("answer")) == 1
    assert details["documents"] == (["t/cities"] if mode == "llm-docs" else ["t/cities", "t/rivers", "t/alps"])
    assert [c.id for c in answer.evidence] == details["nodes"] and answer.evidence
    assert details["tokens"] == sum(c.n_tokens for c in answer.evidence) <= details["budget"]
    assert all(strategy.forest.documents[c.doc_id].text[c.start:c.end] == c.text for c in answer.evidence)
    if route == "documents":
        assert all(c.level == "document" for c in answer.evidence)
        assert [c.doc_id for c in answer.evidence] == details["documents"]  # whole documents, LLM's first
    else:
        # navigation lists the selected documents' non-leaf nodes (their roots) in fused order: 0 is the cities root
        assert details["llm_nodes"] == ([] if mode == "treexp-nodes" else ["t/cities#root"])
        assert bool(details["treexp_nodes"]) == (mode != "llm-nodes")
        assert answer.evidence[0].doc_id == "t/cities" or mode == "treexp-nodes"
    assert strategy.forest.documents and with_config(strategy, mode=mode).name == \
        ("fable" if mode == "fable" else f"fable-{mode}")
    context = backend.prompts("answer")[0]
    assert all(c.text in context for c in answer.evidence)  # every returned node is read whole


def test_fable_goes_to_node_level_when_the_documents_exceed_the_budget(strategy):
    total = sum(strategy.forest.nodes[r].n_tokens for r in strategy.forest.roots.values())
    backend = StandIn(selection=['{"ids": [0]}', '{"ids": [0]}'])
    answer = with_config(strategy, budget_tokens=total - 1).answer(QUESTION, Client(backend))
    assert answer.details["route"] == "nodes" and answer.details["tokens"] <= total - 1
    assert answer.evidence[0].doc_id == "t/rivers"  # the LLM's document first
    assert "t/rivers#root" in answer.details["nodes"]  # chosen by navigation, it covers both rivers leaves
    assert not {"t/rivers#leaf0", "t/rivers#leaf1"} & set(answer.details["nodes"])


def test_hallucinated_and_unparsed_selections_are_counted(strategy):
    backend = StandIn(selection=['{"ids": [0, 7, "x"]}', "I think line two"])
    answer = with_config(strategy, mode="nodes").answer(QUESTION, Client(backend))
    details = answer.details
    assert details["documents_selection_id_failures"] == 2 and details["documents_selection_unparsed"] == 0
    assert details["nodes_selection_unparsed"] == 1 and details["nodes_selection_id_failures"] == 0
    assert details["unparsed_replies"] == [{"step": "nodes", "raw": "I think line two"}]
    assert details["llm_documents"] == ["t/rivers"] and details["llm_nodes"] == []
    assert answer.prediction == "The Nile" and answer.failure == "" and answer.evidence  # TreeExpansion still ran


def test_selection_prompts_show_the_vector_paths_best_documents_and_at_most_llm_max_nodes(strategy):
    backend = StandIn()
    answer = with_config(strategy, llm_max_nodes=2).answer(QUESTION, Client(backend))
    (prompt,) = backend.prompts("selection")
    assert "[0] Rivers: What it covers.\n[1] Cities: What it covers.\n\nReply" in prompt  # corpus order; alps cut
    assert answer.details["documents_nodes_hidden"] == 1
    schema = backend.chats[0][1]["response_format"]["json_schema"]["schema"]["properties"]["ids"]
    assert (schema["items"]["maximum"], schema["maxItems"]) == (1, 4)
    backend = StandIn()
    with_config(strategy, llm_candidates=1).answer(QUESTION, Client(backend))
    (prompt,) = backend.prompts("selection")
    assert "[0] Rivers" in prompt and "[1]" not in prompt  # the one candidate: the best by its nodes' similarity


@pytest.mark.parametrize("mode", ["docs", "treexp-nodes", "nodes"])
def test_a_budget_below_every_node_returns_the_best_node_cut(strategy, mode):
    answer = with_config(strategy, mode=mode, budget_tokens=3).answer(QUESTION, Client(StandIn()))
    (chunk,) = answer.evidence
    whole = strategy.forest.chunk(chunk.id)
    assert answer.details["budget_truncations"] == 1 and chunk.n_tokens == 3 == answer.details["tokens"]
    assert whole.text.startswith(chunk.text) and 0 < len(chunk.text) < len(whole.text)
    assert strategy.forest.documents[chunk.doc_id].text[chunk.start:chunk.end] == chunk.text
    # docs: the first fused document (the LLM's, line 0: rivers); nodes: the LLM's pick too; treexp: the best score
    assert chunk.doc_id == "t/rivers"


def test_a_question_longer_than_the_limit_is_cut_everywhere(strategy):
    question = QUESTION + " river" * 2000
    backend = StandIn()
    answer = with_config(strategy, max_question_chars=60).answer(question, Client(backend))
    assert answer.details["question_truncated"] is True and backend.embedded == [question[:60]]
    assert all(question[:60] in p and question[:61] not in p for p in backend.prompts("selection"))
    assert question[:60] + "\nAnswer:" in backend.prompts("answer")[0]
    assert with_config(strategy).answer(QUESTION, Client(StandIn())).details["question_truncated"] is False


@pytest.mark.parametrize("mode", MODES)
def test_a_scoped_question_is_retrieved_from_its_documents_trees_only(strategy, mode):
    """The river question scoped to the cities document: every path (vector, LLM selection, TreeExpansion) sees the
    cities tree alone, so no river node comes back although the rivers document matches best; unscoped, it does."""
    backend = StandIn()
    answer = with_config(strategy, mode=mode).answer(QUESTION, Client(backend), scope=["t/cities"])
    assert answer.failure == "" and answer.evidence and {c.doc_id for c in answer.evidence} == {"t/cities"}
    assert answer.details["documents"] == ["t/cities"] and answer.details["vector_documents"] == ["t/cities"]
    assert all("Rivers" not in prompt and "Alps" not in prompt for prompt in backend.prompts("selection"))
    opened = with_config(strategy, mode=mode).answer(QUESTION, Client(StandIn()))
    assert "t/rivers" in {c.doc_id for c in opened.evidence}
    with pytest.raises(ConfigError, match="fable_forest has no tree of t/none"):
        strategy.answer(QUESTION, Client(StandIn()), scope=["t/none"])


def test_a_corpus_of_one_document():
    backend = StandIn()
    one = FableStrategy.build(DOCUMENTS[1:2], hierarchy_of(DOCUMENTS[1]), Client(backend))
    for mode in MODES:
        answer = with_config(one, mode=mode).answer("What is the capital of France?", Client(StandIn()))
        assert [c.doc_id for c in answer.evidence] == ["t/cities"] and answer.failure == ""
    with pytest.raises(ConfigError, match="no documents"):
        FableStrategy(Forest([], []))


def test_failed_requests_are_recorded_not_raised(strategy):
    backend = StandIn()
    backend.embed_error = ClientError(0, "embedder down")
    answer = strategy.answer(QUESTION, Client(backend))
    assert (answer.failure, answer.prediction) == ("request_failed", "") and "embedder down" in answer.failure_detail
    # a failed selection leaves the vector path; a failed answer request is the answer's failure
    backend = StandIn(selection=[ClientError(503, "busy")], answer=[ClientError(500, "crashed")])
    answer = strategy.answer(QUESTION, Client(backend))
    assert answer.details["request_failures"] == 1 and answer.details["llm_documents"] == []
    assert answer.failure == "request_failed" and "crashed" in answer.failure_detail
    assert answer.evidence and answer.details["unparsed_replies"][0]["raw"].startswith("<request failed")


@pytest.mark.parametrize("status", [0, 408, 429, 502])
def test_a_transient_selection_failure_is_counted_and_the_vector_path_answers(strategy, status):
    backend = StandIn(selection=[ClientError(status, "try later")])
    answer = strategy.answer(QUESTION, Client(backend))
    assert (answer.prediction, answer.failure) == ("The Nile", "")
    assert answer.details["request_failures"] == 1 and answer.details["llm_documents"] == []
    assert answer.details["vector_documents"] and answer.evidence


@pytest.mark.parametrize("status", [400, 401, 404, 422])
@pytest.mark.parametrize("step, replies", [("documents", []), ("nodes", ['{"ids": [0]}'])])
def test_a_refused_selection_raises_before_any_answer(strategy, step, replies, status):
    """A 4xx (a wrong role or model name, a bad request) fails every question the same way: the strategy raises
    rather than answer from the vector path alone, at the document and at the node level."""
    backend = StandIn(selection=[*replies, ClientError(status, "no model named 'generator'")])
    with pytest.raises(RequestRefused, match=f"FABLE's {step} selection .*{status}"):
        with_config(strategy, mode="nodes").answer(QUESTION, Client(backend))
    assert [name for name, _ in backend.chats] == ["selection"] * (len(replies) + 1)  # no answer was asked for


# ------------------------------------------------------------------------------------------- real models


def test_the_built_in_models_build_a_forest_and_answer_a_hotpotqa_question(engines):
    documents, questions = load_corpus("hotpotqa", ROOT / "data" / "hotpotqa", limit_docs=100)
    question = questions[0]
    gold = [d for d in documents if d.id in question.gold_doc_ids]
    engine = engines(ServeConfig(port=0, roles={
        "generator": RoleConfig(model=SMOLLM2), "embedder": RoleConfig(model=MINILM, kind="embedding")}))
    client = in_process_client(engine)
    hierarchy = hierarchy_of(*gold)
    strategy = FableStrategy.build(gold, hierarchy, client, ForestConfig(segment_max_tokens=48, summary_max_tokens=64),
                                   FableConfig(max_tokens=16), AnswerConfig(max_tokens=16))
    forest = strategy.forest
    assert sorted(forest.documents) == question.gold_doc_ids
    for document in gold:
        leaves = [n for n in forest.nodes.values() if n.doc_id == document.id and n.kind == "leaf"]
        sentences = [c for c in hierarchy if c.doc_id == document.id and c.level == "sentence"]
        # the leaves tile the document's sentences, in order, without overlap
        assert leaves[0].start == sentences[0].start and leaves[-1].end == sentences[-1].end
        assert all(a.end <= b.start for a, b in zip(leaves, leaves[1:]))
        assert sum(n.n_tokens for n in leaves) == sum(s.n_tokens for s in sentences)
    assert all(n.title and n.summary for n in forest.nodes.values() if n.kind != "leaf")
    assert {len(n.embedding) for n in forest.nodes.values()} == {384}
    own = client.fork()
    answer = strategy.answer(question.question, own)
    # the in-process engine fails no request (selection or answer), and the model answers from the documents
    assert answer.failure == "" and answer.prediction, answer
    # two paragraphs fit the budget: both documents come back whole (the LLM's pick first)
    assert answer.details["route"] == "documents" and sorted(c.doc_id for c in answer.evidence) == sorted(forest.roots)
    assert recall_at_k(answer.evidence, question.evidence, 5) == 1.0
    assert own.stats.roles["generator"].requests == 2  # the document selection, the answer
