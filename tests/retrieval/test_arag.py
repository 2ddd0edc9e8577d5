"""A-RAG: its three tools on a hand-made corpus, its agent loop against a scripted stand-in server, and the real
built-in tiny models answering HotpotQA questions with it end to end."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.core.records import Document, Span
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies
from overstory.models.registry import MINILM, SMOLLM2
from overstory.retrieval.arag import (
    FORCE_PROMPT,
    UNPARSED_PROMPT,
    ARagConfig,
    ARagStrategy,
    coerce_arguments,
    keyword_score,
)
from overstory.retrieval.metrics import recall_at_k
from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.in_process import in_process_client

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = [
    Document("t/rivers", "Rivers", "Rivers flow to the sea. Ok. The Nile is the longest river. "
                                   "The Nile runs through Egypt and Sudan."),
    Document("t/mountains", "Mountains", "Mountains are tall. The Alps are in Europe."),
    Document("t/cities", "Cities", "Paris is the capital of France. Paris has the Eiffel Tower."),
    Document("t/apples", "Apples", "One apple. Two apples. Three apples. Four apples. Five apples. Six apples."),
]
QUERY = "which river is longest"
# Known embeddings give exact similarities to QUERY (cosine = the first coordinate); any other text embeds
# orthogonally to the query (similarity 0).
VECTORS = {QUERY: [1.0, 0.0, 0.0],
           "Ok.": [1.0, 0.0, 0.0],  # would be the best match, but 10 characters or fewer are never indexed
           "The Nile is the longest river.": [0.8, 0.6, 0.0],
           "Mountains are tall.": [0.7, 0.71414284, 0.0],
           "Rivers flow to the sea.": [0.6, 0.8, 0.0],
           "The Nile runs through Egypt and Sudan.": [0.5, 0.8660254, 0.0]}


class StandIn:
    """Stands in for the served generator and embedder (the ``Backend`` of serving/client.py): a real tiny model
    cannot be made to emit a given malformed call on demand, and exact similarities need known vectors. Chat
    requests get the scripted replies in order (an exception in the script is raised instead) and are kept;
    an embedding is ``VECTORS[text]``, else a vector orthogonal to the query's."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.chats: list[dict] = []
        self.embedded: list[str] = []

    def post(self, path, payload):
        if path == "/v1/embeddings":
            self.embedded += payload["input"]
            data = [{"index": i, "embedding": VECTORS.get(text, [0.0, 0.0, 1.0])}
                    for i, text in enumerate(payload["input"])]
            return {"data": data, "usage": {"prompt_tokens": 0, "total_tokens": 0}}, 0
        self.chats.append(copy.deepcopy(payload))  # the strategy goes on appending to the same message list
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply, 0

    def get(self, path):
        return [{}]

    def close(self):
        pass


def said(text, context_tokens=50):
    """An OpenAI-shaped text reply whose usage adds up to ``context_tokens``."""
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": context_tokens - 5, "completion_tokens": 5, "total_tokens": context_tokens}}


def called(*calls, context_tokens=50):
    """An OpenAI-shaped reply calling tools: each call is (name, arguments), a dict sent JSON-encoded (as servers
    do) or a string sent as it is."""
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
        for i, (name, arguments) in enumerate(calls)]
    reply = said(None, context_tokens)
    reply["choices"][0].update(message={"role": "assistant", "content": None, "tool_calls": tool_calls},
                               finish_reason="tool_calls")
    return reply


@pytest.fixture(scope="module")
def hierarchy():
    return build_hierarchies(DOCUMENTS, HierarchyConfig())


@pytest.fixture(scope="module")
def strategy(hierarchy):
    """One chunk per document: 0 rivers, 1 mountains, 2 cities, 3 apples."""
    return ARagStrategy.build(hierarchy, Client(StandIn()), ARagConfig(max_turns=3))


def with_config(strategy, **changes):
    """The built strategy (chunks and index shared) under another config."""
    return ARagStrategy(list(zip(strategy.chunks, strategy.sentences)), strategy.index,
                        ARagConfig(**{"max_turns": 3, **changes}))


@pytest.mark.parametrize("key, value", [("chunk_tokens", 0), ("max_turns", -1), ("max_context_tokens", -1),
                                        ("max_tokens", 0), ("embed_batch_size", 0)])
def test_config_names_the_bad_key(key, value):
    with pytest.raises(ConfigError, match=f"arag.{key}"):
        ARagConfig(**{key: value})


def test_chunks_are_sentence_runs_with_document_offsets(hierarchy, strategy):
    small = ARagStrategy.build(hierarchy, Client(StandIn()), ARagConfig(chunk_tokens=8))
    texts = {d.id: d.text for d in DOCUMENTS}
    assert all(texts[c.doc_id][c.start:c.end] == c.text for built in (strategy, small) for c in built.chunks)
    assert [c.doc_id for c in strategy.chunks] == [d.id for d in DOCUMENTS]
    order = [d.id for d in DOCUMENTS]
    assert [order.index(c.doc_id) for c in small.chunks] == sorted(order.index(c.doc_id) for c in small.chunks)
    # 7 + 2 tokens are over 8: the first sentences of the rivers document part
    assert [c.text for c in small.chunks[:2]] == ["Rivers flow to the sea.", "Ok."]
    nile = Span("t/rivers", texts["t/rivers"].index("The Nile is"), len(texts["t/rivers"]))
    assert recall_at_k(small.chunks[2:3], [nile], 1) == 1.0


def test_keyword_scores_and_snippets(strategy):
    rivers, _, cities, apples = (c.text for c in strategy.chunks)
    assert keyword_score(rivers, ["nile", "paris"]) == 2 * 4
    assert keyword_score(cities, ["NILE", "Paris"]) == 2 * 5
    assert keyword_score(apples, ["apple", "six"]) == 6 * 5 + 1 * 3
    found = strategy.keyword_search(["nile", "paris"])
    assert found.chunk_ids == [2, 0]  # 10 before 8
    assert found.text.splitlines()[0] == ("Chunk 2 (Cities): ... Paris is the capital of France. ... "
                                          "Paris has the Eiffel Tower. ...")
    assert "Rivers flow" not in found.text  # only sentences holding a keyword
    assert strategy.keyword_search(["nile", "paris"], top_k=1).chunk_ids == [2]
    assert strategy.keyword_search(["apple"]).text.count("apple") == 5  # at most 5 snippets a chunk
    missing = strategy.keyword_search(["zebra"])
    assert missing.chunk_ids == [] and "No chunk" in missing.text


def test_semantic_search_scores_a_chunk_by_its_best_sentence(strategy):
    backend = StandIn()
    indexed = {s.text for s in strategy.index.chunks}
    assert "Ok." not in indexed and "One apple." not in indexed and "Two apples." in indexed  # 10 out, 11 in
    # top_k=1 ranks the 3 best sentences: Nile longest 0.8, Mountains 0.7, Rivers flow 0.6
    one = strategy.semantic_search(QUERY, Client(backend), top_k=1)
    assert one.chunk_ids == [0]
    assert one.text == ("Chunk 0 (Rivers) (similarity 0.800): ... Rivers flow to the sea. ... "
                        "The Nile is the longest river. ...")
    assert backend.embedded == [QUERY]  # the query goes through the client it was given
    two = strategy.semantic_search(QUERY, Client(backend), top_k=2)
    assert two.chunk_ids == [0, 1] and "(similarity 0.700)" in two.text
    assert "Egypt and Sudan" in two.text  # 0.5 is among the 6 best sentences now


def test_read_chunk_notices_neighbours_and_unknown_ids(hierarchy):
    small = ARagStrategy.build(hierarchy, Client(StandIn()), ARagConfig(chunk_tokens=8))
    first = small.read_chunk([2])
    assert first.chunk_ids == [2] and "The Nile is the longest river." in first.text and first.tokens == 7
    again = small.read_chunk([2, 3], already_read=[2])
    assert "Chunk 2 was already read." in again.text and again.chunk_ids == [3]
    assert again.tokens == small.chunks[3].n_tokens
    before, after = small.chunks[1], small.chunks[3]  # chunk 2's neighbours in its document
    assert before.doc_id == after.doc_id == "t/rivers" and before.end < small.chunks[2].start < after.start
    neighbours = small.read_chunk([1, 3])
    assert "Ok." in neighbours.text and "Egypt" in neighbours.text
    unknown = small.read_chunk([-1, 99])
    assert unknown.chunk_ids == [] and unknown.tokens == 0
    assert unknown.text.count("does not exist") == 2


def test_a_scoped_question_sees_its_documents_chunks_only(strategy):
    """Scoped to the cities document, the agent's keyword search for Nile and Paris finds the cities chunk alone,
    the Nile chunk it then asks for is refused, and its evidence is the cities chunk; the semantic search of a
    mountains-scoped question ranks the mountains chunk alone (its sentence is second best over the corpus)."""
    backend = StandIn(called(("keyword_search", {"keywords": ["Nile", "Paris"]})),
                      called(("read_chunk", {"chunk_ids": [0, 2]})), said("Paris"))
    answer = strategy.answer("Which river is the longest?", Client(backend), scope=["t/cities"])
    assert answer.failure == "" and [c.doc_id for c in answer.evidence] == ["t/cities"]
    found, read = (m["content"] for m in backend.chats[-1]["messages"] if m["role"] == "tool")
    assert found.startswith("Chunk 2 (Cities)") and "Chunk 0" not in found
    assert "Chunk 0 is not in the document this question is about." in read and answer.details["chunks_read"] == [2]
    assert strategy.semantic_search(QUERY, Client(StandIn()), top_k=2, scope=["t/mountains"]).chunk_ids == [1]
    assert strategy.semantic_search(QUERY, Client(StandIn()), top_k=2).chunk_ids == [0, 1]
    assert strategy.keyword_search(["Nile", "Paris"], scope=["t/apples"]).chunk_ids == []


@pytest.mark.parametrize("name, arguments, expected, kinds", [
    ("read_chunk", {"chunk_ids": [1, "2", "chunk 3"]}, {"chunk_ids": [1, 2, 3]}, []),
    ("read_chunk", {"chunk_ids": "[1, 2]"}, {"chunk_ids": [1, 2]}, ["not_a_list"]),
    ("read_chunk", {"chunk_ids": 4}, {"chunk_ids": [4]}, ["not_a_list"]),
    ("read_chunk", {"chunk_ids": ["x", 5]}, {"chunk_ids": [5]}, ["bad_value"]),
    ("read_chunk", {"chunk_ids": ["x"]}, None, ["bad_value"]),
    ("keyword_search", {"keywords": ["Nile"], "top_k": 50}, {"keywords": ["Nile"], "top_k": 20}, []),
    ("semantic_search", {"query": ["longest", "river"]}, {"query": "longest river", "top_k": 5}, ["bad_value"]),
    ("semantic_search", "not json", None, ["bad_arguments"]),
    ("keyword_search", None, None, ["missing_argument"]),
])
def test_arguments_are_repaired_or_refused_by_kind(name, arguments, expected, kinds):
    assert coerce_arguments(name, arguments) == (expected, kinds)


def test_a_tool_call_then_an_answer(strategy):
    backend = StandIn(called(("keyword_search", {"keywords": ["Nile"]})), called(("read_chunk", {"chunk_ids": [0]})),
                      said("The Nile.\nIt is in the chunk."))
    answer = strategy.answer("Which river is the longest?", Client(backend))
    assert (answer.prediction, answer.failure) == ("The Nile", "")
    assert answer.details["turns"] == 3 and answer.details["stopped_by"] == "answer"
    assert answer.details["tool_failures"] == {} and answer.details["chunks_read"] == [0]
    assert [c.doc_id for c in answer.evidence] == ["t/rivers"]
    last = backend.chats[-1]
    assert last["tools"] and last["tool_choice"] == "auto" and last["temperature"] == 0
    roles = [m["role"] for m in last["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last["messages"][3]["tool_call_id"] == last["messages"][2]["tool_calls"][0]["id"]
    assert "The Nile is the longest river." in last["messages"][5]["content"]


def test_untagged_calls_run_truncated_calls_and_template_echoes_get_a_reminder(strategy):
    backend = StandIn(said('{"name": "keyword_search", "arguments": {"keywords": ["Nile"]}}'),
                      said("<tool_response>"), said('{"name": "read_chunk", "arguments": {"chunk_ids": [0, 0, 0'),
                      said("<tool_response>The Nile"))
    answer = with_config(strategy, max_turns=5).answer("Which river is the longest?", Client(backend))
    assert (answer.prediction, answer.failure) == ("The Nile", "")
    assert answer.details["tool_failures"] == {"untagged_call": 1, "template_echo": 1, "truncated_call": 1}
    assert [c["name"] for c in answer.details["calls"]] == ["keyword_search"] and answer.details["turns"] == 4
    assert "Chunk 0" in backend.chats[1]["messages"][3]["content"]  # the search ran: its result is in the history
    assert backend.chats[2]["messages"][-1]["content"] == UNPARSED_PROMPT


def test_first_tool_choice_required_forces_only_the_first_turn(strategy):
    backend = StandIn(called(("keyword_search", {"keywords": ["Nile"]})), said("The Nile."))
    answer = with_config(strategy, first_tool_choice="required").answer("Which river?", Client(backend))
    assert answer.prediction == "The Nile"
    assert [chat["tool_choice"] for chat in backend.chats] == ["required", "auto"]


def test_a_model_that_never_calls_a_tool(strategy):
    answer = strategy.answer("What is the capital of France?", Client(StandIn(said("Answer: Paris."))))
    assert answer.prediction == "Paris" and answer.raw == "Answer: Paris."
    assert answer.details["turns"] == 1 and answer.evidence == [] and answer.failure == ""


def test_a_model_that_never_stops_calling_tools_is_forced_to_answer(strategy):
    searches = [called(("semantic_search", {"query": QUERY})) for _ in range(3)]
    backend = StandIn(*searches, said("The Nile"))
    answer = strategy.answer("Which river is the longest?", Client(backend))
    assert answer.prediction == "The Nile" and answer.failure == ""
    assert answer.details["turns"] == 3 and answer.details["stopped_by"] == "max_turns"
    forced = backend.chats[-1]
    assert "tools" not in forced and forced["messages"][-1] == {"role": "user", "content": FORCE_PROMPT}
    # nothing was read: the evidence is what the three searches returned (every chunk), deduplicated
    assert [c.doc_id for c in answer.evidence][:2] == ["t/rivers", "t/mountains"] and len(answer.evidence) == 4


def test_malformed_calls_are_counted_by_kind_and_the_loop_goes_on(strategy):
    backend = StandIn(
        called(("read_chunk", json.dumps(json.dumps({"chunk_ids": "2, 1"})))),  # encoded twice, a string for a list
        called(("search_web", {"q": "Nile"})),
        called(("keyword_search", "{keywords: Nile")),
        called(("semantic_search", {"top_k": 3})),
        said('<tool_call>{"name": "read_chunk", "arguments": {"chunk_ids": [0]</tool_call>'),
        said("Paris"))
    answer = with_config(strategy, max_turns=6).answer("What is the capital of France?", Client(backend))
    assert answer.prediction == "Paris" and answer.details["turns"] == 6
    assert answer.details["tool_failures"] == {"arguments_as_string": 1, "not_a_list": 1, "unknown_tool": 1,
                                               "bad_arguments": 1, "missing_argument": 1, "unparsed_call": 1}
    assert answer.details["chunks_read"] == [2, 1]  # the repaired call ran
    messages = backend.chats[-1]["messages"]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    assert "Paris is the capital" in results[0] and results[1].startswith("Error: there is no tool 'search_web'")
    assert results[2] == "Error: the arguments must be a JSON object." and "needs the argument 'query'" in results[3]
    # the history carries every call's arguments as a JSON object, so a real server takes it back
    sent = [c["function"]["arguments"] for m in messages if m.get("tool_calls") for c in m["tool_calls"]]
    assert [json.loads(a) for a in sent] == [{"chunk_ids": [2, 1]}, {}, {}, {}]
    assert messages[-1]["role"] == "user" and "could not be read" in messages[-1]["content"]


@pytest.mark.parametrize("parallel, read", [(False, [0]), (True, [0, 2])])
def test_parallel_tool_calls_runs_every_call_of_a_reply(strategy, parallel, read):
    backend = StandIn(called(("read_chunk", {"chunk_ids": [0]}), ("read_chunk", {"chunk_ids": [2]})), said("Nile"))
    answer = with_config(strategy, parallel_tool_calls=parallel).answer("q", Client(backend))
    assert answer.details["chunks_read"] == read and backend.chats[0]["parallel_tool_calls"] is parallel
    assert sum(m["role"] == "tool" for m in backend.chats[-1]["messages"]) == len(read)


def test_the_token_budget_forces_the_answer(strategy):
    backend = StandIn(said("Paris"))
    answer = with_config(strategy, max_context_tokens=0).answer("What is the capital of France?", Client(backend))
    assert answer.prediction == "Paris" and answer.details["stopped_by"] == "budget"
    assert answer.details["turns"] == 0 and "tools" not in backend.chats[0]
    # a reply that brings the context to the budget: the next request is the forced answer
    backend = StandIn(called(("read_chunk", {"chunk_ids": [2]}), context_tokens=120), said("Paris"))
    answer = with_config(strategy, max_context_tokens=120).answer("What is the capital of France?", Client(backend))
    assert answer.details["turns"] == 1 and answer.details["stopped_by"] == "budget"
    assert answer.details["context_tokens"] == 120 and "tools" not in backend.chats[-1]


def test_failed_requests_and_missing_answers_are_recorded(strategy):
    backend = StandIn(called(("keyword_search", {"keywords": ["Paris"]})), ClientError(500, "engine crashed", 3))
    answer = strategy.answer("What is the capital of France?", Client(backend))
    assert (answer.failure, answer.prediction, answer.details["stopped_by"]) == ("request_failed", "", "request_failed")
    assert "engine crashed" in answer.failure_detail and answer.details["turns"] == 1
    assert [c.doc_id for c in answer.evidence] == ["t/cities"]  # what was found before the failure
    # a forced answer that is one more tool call holds no answer
    call_text = '<tool_call>{"name": "read_chunk", "arguments": {"chunk_ids": [1]}}</tool_call>'
    answer = strategy.answer("q", Client(StandIn(said(""))))
    assert (answer.failure, answer.prediction) == ("no_answer", "") and answer.failure_detail == ""
    answer = with_config(strategy, max_turns=0).answer("q", Client(StandIn(said(call_text))))
    assert (answer.failure, answer.failure_detail) == ("no_answer", call_text)


def test_the_built_in_models_answer_hotpotqa_questions(engines):
    documents, questions = load_corpus("hotpotqa", ROOT / "data" / "hotpotqa", limit_docs=100)
    engine = engines(ServeConfig(port=0, roles={
        "generator": RoleConfig(model=SMOLLM2), "embedder": RoleConfig(model=MINILM, kind="embedding")}))
    client = in_process_client(engine)
    strategy = ARagStrategy.build(build_hierarchies(documents, HierarchyConfig()), client,
                                  ARagConfig(max_turns=3, max_tokens=64, first_tool_choice="required"))
    for question in questions[:2]:
        own = client.fork()
        answer = strategy.answer(question.question, own)
        # the in-process engine fails no request, and the model gives an answer (a tool call, then text)
        assert answer.failure == "" and answer.prediction, answer
        turns, stopped_by = answer.details["turns"], answer.details["stopped_by"]
        assert answer.details["calls"], answer.details  # the first reply is constrained to a tool call
        forced = stopped_by in ("max_turns", "budget")
        # every generator request is a turn, or the forced answer
        assert own.stats.roles["generator"].requests == turns + forced
        assert all(c in strategy.chunks for c in answer.evidence)
