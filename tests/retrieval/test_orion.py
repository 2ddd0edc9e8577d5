"""Orion-RAG: weighted RRF, sliding-window chunks and semantic paths by exact values; tagging and answering against a
scripted stand-in server; re-indexing one document; and the real built-in tiny models tagging HotpotQA documents
and answering a question end to end."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import xgrammar as xgr

from overstory.core.config import ConfigError
from overstory.core.records import Document, Span, read_jsonl, write_jsonl
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.orion_index import tag_and_index
from overstory.models.registry import MINILM, SMOLLM2, load_tokenizer
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.metrics import recall_at_k
from overstory.retrieval.orion.query import weighted_rrf
from overstory.retrieval.orion.strategy import PROBE, FusionWeights, OrionConfig, OrionStrategy
from overstory.retrieval.orion.tagger import (
    PARAGRAPH_TAGS_FORMAT,
    RETRY_PROMPT,
    TAG_PATTERN,
    ChunkingConfig,
    Tagger,
    TaggingConfig,
    chunk_document,
    fallback_master_tags,
    master_tags_format,
    window_spans,
)
from overstory.retrieval.orion.tags import (
    CHUNKS_FILE,
    MASTERS_FILE,
    TAG_MAX_WORDS,
    ChunkTags,
    DocumentTags,
    semantic_path,
)
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.in_process import in_process_client
from overstory.serving.structured import GrammarCompilerCache, grammar_spec

ROOT = Path(__file__).resolve().parents[2]

DOCUMENTS = [
    Document("t/paris", "Paris", "Paris is the capital of France. The Eiffel Tower stands in Paris."),
    Document("t/nile", "Nile", "The Nile is the longest river in Africa. It flows through Egypt."),
    Document("t/alps", "Alps", "The Alps are a mountain range in Europe. Mont Blanc is their highest peak."),
]
MASTERS = {"t/paris": ["Paris", "France"], "t/nile": ["Nile", "Egypt"], "t/alps": ["Alps", "Europe"]}
PARAGRAPH = {"t/paris": ["capital of France", "Paris", "geography"], "t/nile": ["longest African river", "Nile",
                                                                                 "geography"],
             "t/alps": ["European mountain range", "Alps", "alpinism"]}  # "alpinism": in no text
VOCAB = ["paris", "france", "capital", "tower", "nile", "river", "egypt", "alps", "mountain", "europe",
         "alpinism"]


def said(text: str) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


class StandIn:
    """Stands in for the served generator and embedder (the ``Backend`` of serving/client.py): a real tiny model
    cannot be made to emit a malformed, empty or failed reply on demand, and exact rankings need known embeddings.
    Chat requests are kept and answered by ``replies``: a list taken in order, or a function of the request (the
    strategy prunes concurrently, so its order is not fixed); a string becomes the reply, an exception is raised.
    An embedding is a bag of words over ``VOCAB`` (plus 0.01, so no vector is zero), reversed and shifted when
    ``other`` (a different embedder); every embedded text is kept."""

    def __init__(self, replies=(), other: bool = False):
        self.replies = replies if callable(replies) else list(replies)
        self.other = other
        self.chats: list[dict] = []
        self.embedded: list[str] = []
        self.lock = threading.Lock()

    def post(self, path, payload):
        if path == "/v1/embeddings":
            self.embedded += payload["input"]
            data = [{"index": i, "embedding": embedding(text, self.other)} for i, text in enumerate(payload["input"])]
            return {"data": data, "usage": {"prompt_tokens": 0, "total_tokens": 0}}, 0
        with self.lock:
            self.chats.append(payload)
            reply = self.replies(payload) if callable(self.replies) else self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return said(reply), 0

    def get(self, path):
        return [{}]

    def close(self):
        pass


def embedding(text: str, other: bool = False) -> list[float]:
    words = text.lower().replace(".", " ").replace(",", " ").split()
    vector = [words.count(w) + 0.01 for w in VOCAB]
    return [vector[-1] + 1, *vector[-2::-1]] if other else vector


def schema_name(payload: dict) -> str:
    return (payload.get("response_format") or {}).get("json_schema", {}).get("name", "")


def passage(payload: dict) -> str:
    return payload["messages"][-1]["content"]


def write_tags(folder: Path, documents=DOCUMENTS) -> Path:
    """A tag folder as the tagging job writes it (one chunk per document), with the tags above."""
    write_jsonl(folder / MASTERS_FILE, [DocumentTags(d.id, d.title, MASTERS[d.id], "llm") for d in documents])
    chunks = [c for d in documents for c in chunk_document(d, ChunkingConfig())]
    write_jsonl(folder / CHUNKS_FILE, [ChunkTags(c.id, c.doc_id, c.title, c.text, c.start, c.end, PARAGRAPH[c.doc_id],
                                                 "llm") for c in chunks])
    return folder


@pytest.fixture
def tags(tmp_path) -> Path:
    return write_tags(tmp_path)


def build(folder: Path, backend: StandIn | None = None, **changes) -> OrionStrategy:
    config = OrionConfig(**{"tags": str(folder), "top_k": 2, **changes})
    return OrionStrategy.build(Client(backend or StandIn()), config, AnswerConfig())


# ----------------------------------------------------------------------------------------------- exact values


def test_weighted_rrf_by_hand():
    rankings = {"tag": ["a", "b", "c"], "semantic": ["b", "a"], "sparse": ["c"]}
    fused = weighted_rrf(rankings, {"tag": 0.25, "semantic": 0.25, "sparse": 0.5})
    # c: 0.25/63 + 0.5/61; a: 0.25/61 + 0.25/62; b: 0.25/62 + 0.25/61 (a tie: a was met first)
    assert [d for d, _ in fused] == ["c", "a", "b"]
    assert fused[0][1] == pytest.approx(0.25 / 63 + 0.5 / 61, abs=1e-12)
    assert fused[1][1] == pytest.approx(0.0081306188, abs=1e-10) and fused[1][1] == fused[2][1]
    assert weighted_rrf({"tag": ["a"]}, {"tag": 1.0}, k=0) == [("a", 1.0)]  # ranks start at 1
    assert weighted_rrf({"tag": ["a", "a", "b"]}, {"tag": 1.0}, k=0) == [("a", 1.0), ("b", 0.5)]
    assert weighted_rrf({"tag": ["a"], "sparse": ["b"]}, {"tag": 0.0, "sparse": 1.0}) == [("b", 1 / 61)]
    with pytest.raises(ValueError, match="no weight for the ranking 'dense'"):
        weighted_rrf({"dense": ["a"]}, {"tag": 1.0})


def test_sliding_windows_cut_on_whitespace_with_document_offsets():
    text = "Alpha beta gamma delta. Epsilon zeta eta theta iota."
    assert window_spans(text, 20) == [(0, 16), (17, 36), (37, 52)]
    assert [text[s:e] for s, e in window_spans(text, 20)] == ["Alpha beta gamma", "delta. Epsilon zeta",
                                                             "eta theta iota."]
    # overlap: a window starts 8 characters before the previous one ends, moved forward to a word
    assert [text[s:e] for s, e in window_spans(text, 20, overlap_chars=8)] == [
        "Alpha beta gamma", "gamma delta. Epsilon", "Epsilon zeta eta", "zeta eta theta iota."]
    assert window_spans(text, 20, overlap_chars=8) == [(0, 16), (11, 31), (24, 40), (32, 52)]
    assert window_spans("abcdefghij", 4) == [(0, 4), (4, 8), (8, 10)]  # a word longer than the window is cut
    assert window_spans("   ", 5) == [] and window_spans("one", 500) == [(0, 3)]
    document = Document("d/1", "Greek", text)
    chunks = chunk_document(document, ChunkingConfig(chunk_chars=20))
    assert [c.id for c in chunks] == ["d/1#w0", "d/1#w1", "d/1#w2"]
    assert all(c.text == text[c.start:c.end] and c.title == "Greek" and len(c.text) <= 20 for c in chunks)
    gold = Span("d/1", text.index("Epsilon"), text.index("Epsilon") + 7)
    assert recall_at_k(chunks[1:2], [gold], 1) == 1.0 and recall_at_k(chunks[2:], [gold], 1) == 0.0


def test_windows_of_a_real_document_lose_no_word():
    document = load_corpus("hotpotqa", ROOT / "data" / "hotpotqa", limit_docs=1)[0][0]
    for chunk_chars in (50, 500, 2000):
        chunks = chunk_document(document, ChunkingConfig(chunk_chars=chunk_chars))
        assert " ".join(c.text for c in chunks).split() == document.text.split()
        assert all(len(c.text) <= chunk_chars and c.text == document.text[c.start:c.end] for c in chunks)
    assert len(chunk_document(document, ChunkingConfig(chunk_chars=2000))) == 1


def test_semantic_paths(tags):
    assert semantic_path(["Nile", "Egypt"], ["longest river", "Nile", "geography"]) == \
        "Nile, Egypt > longest river > Nile > geography"
    strategy = build(tags)
    assert [row.text for row in strategy.path_index.chunks] == [
        "Paris, France > capital of France > Paris > geography",
        "Nile, Egypt > longest African river > Nile > geography",
        "Alps, Europe > European mountain range > Alps > alpinism"]


@pytest.mark.parametrize("make, key", [
    (lambda: ChunkingConfig(chunk_chars=0), "chunking.chunk_chars"),
    (lambda: ChunkingConfig(chunk_chars=10, overlap_chars=10), "chunking.overlap_chars"),
    (lambda: ChunkingConfig(overlap_chars=-1), "chunking.overlap_chars"),
    (lambda: TaggingConfig(max_master_tags=0), "tagging.max_master_tags"),
    (lambda: TaggingConfig(max_attempts=0), "tagging.max_attempts"),
    (lambda: OrionConfig(weights=FusionWeights(tag=-0.1)), "orion.weights.tag"),
    (lambda: OrionConfig(weights=FusionWeights(sparse=-1)), "orion.weights.sparse"),
    (lambda: OrionConfig(weights=FusionWeights(0, 0, 0)), "orion.weights"),
    (lambda: OrionConfig(top_k=0), "orion.top_k"),
    (lambda: OrionConfig(rewrite_max=-1), "orion.rewrite_max"),
    (lambda: OrionConfig(max_query_chars=0), "orion.max_query_chars"),
])
def test_configs_name_the_bad_key(make, key):
    with pytest.raises(ConfigError, match=key):
        make()


# ------------------------------------------------------------------------------------------------------ tagging


def test_an_unusable_reply_is_shown_back_and_asked_again():
    reply = '{"tags": ["Paris", "  France ", "paris", "up", "Eiffel Tower in the north", "City of Light"]}'
    backend = StandIn(["Paris, France", reply])
    tagged = Tagger(Client(backend), TaggingConfig()).master(DOCUMENTS[0])
    # cleaned, distinct, at most 4 words, "up" (no content word) dropped; "City of Light", not in the text, is kept
    # beside tags that are
    tags = ["Paris", "France", "Eiffel Tower in the", "City of Light"]
    assert tagged.record == DocumentTags("t/paris", "Paris", tags, "llm")
    assert tagged.failure is None and tagged.calls == 2
    schema = backend.chats[0]["response_format"]["json_schema"]["schema"]["properties"]["tags"]
    assert schema["maxItems"] == 5 and schema["items"]["pattern"] == TAG_PATTERN
    assert backend.chats[0]["temperature"] == 0
    retry = backend.chats[1]["messages"]
    assert [m["role"] for m in retry] == ["user", "assistant", "user"]
    assert retry[1]["content"] == "Paris, France" and retry[2]["content"] == RETRY_PROMPT


def test_empty_or_ungrounded_tags_fall_back_with_the_raw_reply_kept():
    backend = StandIn(['{"tags": []}', '{"tags": ["", " ", "up", "1", "Reply with JSON"]}'])
    tagged = Tagger(Client(backend), TaggingConfig()).master(DOCUMENTS[0])
    assert tagged.record.source == "fallback" and tagged.calls == 2
    assert tagged.record.tags == ["Paris", "capital", "france", "eiffel", "tower"]
    assert tagged.record.tags == fallback_master_tags("Paris", DOCUMENTS[0].text, 5)
    assert (tagged.failure.id, tagged.failure.attempts) == ("t/paris", 2) and "Reply with JSON" in tagged.failure.raw


def test_paragraph_tags_are_three_of_at_most_four_words():
    chunk = chunk_document(DOCUMENTS[1], ChunkingConfig())[0]
    long_gist = json.dumps({"gist": "the Nile is the longest river", "subjects": "Nile", "domain": "Geography."})
    tagged = Tagger(Client(StandIn([long_gist])), TaggingConfig()).paragraph(chunk)
    assert tagged.record.tags == ["the Nile is the", "Nile", "Geography"] and tagged.record.source == "llm"
    assert (tagged.record.text, tagged.record.start, tagged.record.end) == (chunk.text, chunk.start, chunk.end)
    missing = json.dumps({"gist": "longest river", "subjects": "Nile"})
    failed = ClientError(500, "engine crashed")
    tagged = Tagger(Client(StandIn([missing, failed])), TaggingConfig()).paragraph(chunk)
    assert tagged.record.source == "fallback" and len(tagged.record.tags) == 3
    assert tagged.record.tags == ["The Nile is the", "nile longest", "Nile"]
    assert all(1 <= len(tag.split()) <= TAG_MAX_WORDS for tag in tagged.record.tags)
    assert tagged.failure.raw == "<request failed: 500: engine crashed>"
    copied = json.dumps({"gist": "The Nile is", "subjects": "The Nile is", "domain": "The Nile is"})
    labels = json.dumps({"gist": "Nile river", "subjects": "Subjects", "domain": "geography"})
    tagged = Tagger(Client(StandIn([copied, labels])), TaggingConfig()).paragraph(chunk)
    assert tagged.record.source == "fallback" and tagged.failure.raw == labels  # neither is three facets


@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_refused_tagging_request_raises_naming_the_role(status):
    """A 4xx would fail every item alike: the tagger raises instead of asking again and falling back (the data job
    stops); a transient failure is asked again, then falls back with the error as its raw reply."""
    refused = ClientError(status, "no model named 'generator'")
    backend = StandIn([refused])
    with pytest.raises(RequestRefused, match=rf"Orion-RAG's master tags request \(role 'generator'\): .*no model "
                                             rf"named 'generator' \(HTTP {status}\)"):
        Tagger(Client(backend), TaggingConfig()).master(DOCUMENTS[0])
    assert len(backend.chats) == 1  # not asked again
    chunk = chunk_document(DOCUMENTS[1], ChunkingConfig())[0]
    with pytest.raises(RequestRefused, match=r"Orion-RAG's paragraph tags request \(role 'generator'\)"):
        Tagger(Client(StandIn([ClientError(503, "busy"), refused])), TaggingConfig()).paragraph(chunk)
    tagged = Tagger(Client(StandIn([ClientError(503, "busy"), ClientError(429, "slow down")])),
                    TaggingConfig()).paragraph(chunk)
    assert (tagged.record.source, tagged.calls) == ("fallback", 2)
    assert tagged.failure.raw == "<request failed: 429: slow down>"


def test_the_tag_grammar_refuses_the_placeholder_the_prompt_shows_and_long_tags():
    """SmolLM2 wrote the reply form's "..." back as every master tag; the grammar its tokens are masked by refuses a
    tag that begins with whitespace or ASCII punctuation, and takes one in any script. It also holds a tag to 4 words
    of at most 20 characters: the bound is in the pattern, since xgrammar ignores maxLength beside one (SmolLM2 then
    copied whole passages into the gist)."""
    compilers = GrammarCompilerCache(load_tokenizer(SMOLLM2), 49152)

    def accepts(response_format: dict, reply: str) -> bool:
        matcher = xgr.GrammarMatcher(compilers.compile(grammar_spec(response_format)))
        return matcher.accept_string(reply) and matcher.is_completed()

    masters = master_tags_format(5)
    assert not accepts(masters, '{"tags": ["...", "..."]}') and not accepts(masters, '{"tags": [" Nile"]}')
    assert accepts(masters, '{"tags": ["Nile", "Égypte", "2003 film", "Cairo, Egypt"]}')
    assert not accepts(PARAGRAPH_TAGS_FORMAT, '{"gist": "...", "subjects": "Nile", "domain": "geography"}')
    assert accepts(PARAGRAPH_TAGS_FORMAT, '{"gist": "longest river", "subjects": "Nile", "domain": "geography"}')
    assert accepts(PARAGRAPH_TAGS_FORMAT, '{"gist": "Nile floods each summer", "subjects": "Nile", "domain": "x"}')
    assert not accepts(PARAGRAPH_TAGS_FORMAT, '{"gist": "the Nile floods each summer", "subjects": "Nile", '
                                              '"domain": "geography"}')
    assert not accepts(masters, '{"tags": ["up-down-up-down-up-down-up"]}')  # one run-on "word" of 27 characters


# ---------------------------------------------------------------------------------------------------- retrieval


def test_each_weight_drives_its_own_index(tags):
    """'alpinism' is in the Alps chunk's path only: the tag index finds it, BM25 over the texts cannot."""
    tag_only = build(tags, weights=FusionWeights(tag=1, semantic=0, sparse=0), top_k=1)
    assert tag_only.retrieve(["alpinism"], Client(StandIn())) == [[("t/alps#w0", 1 / 61)]]
    sparse_only = build(tags, weights=FusionWeights(tag=0, semantic=0, sparse=1))
    assert sparse_only.retrieve(["alpinism"], Client(StandIn())) == [[]]
    assert [cid for cid, _ in sparse_only.retrieve(["Egypt river"], Client(StandIn()))[0]] == ["t/nile#w0"]


def prune_and_answer(payload):
    """The scripted server of the answer tests: two rewrites, pruning that keeps only the Paris sentence (the first of
    its passage, numbered), 'Paris.'."""
    if schema_name(payload) == "sub_queries":
        return json.dumps({"queries": ["capital of France", "capital of France", "Eiffel Tower location"]})
    if schema_name(payload) == "pruned":
        keep = [1] if "[1] Paris is the capital of France.\n[2] The Eiffel Tower" in passage(payload) else []
        return json.dumps({"keep": keep})
    return "Paris."


def test_a_question_is_rewritten_fused_pruned_and_answered_per_sub_query(tags):
    backend = StandIn(prune_and_answer)
    client = Client(backend)
    answer = build(tags).answer("What is the capital of France?", client)
    assert (answer.prediction, answer.raw, answer.failure) == ("Paris", "Paris.", "")
    details = answer.details
    assert details["sub_queries"] == ["What is the capital of France?", "capital of France", "Eiffel Tower location"]
    pairs = sum(len(ids) for ids in details["fused"])
    assert pairs == 6 and details["prune_calls"] == 6  # top 2 of 3 sub-queries
    assert client.stats.roles["generator"].requests == 1 + 6 + 1  # rewrite, pruning, answer
    assert client.stats.roles["embedder"].requests == 1  # the sub-queries in one request
    kept = sum(ids.count("t/paris#w0") for ids in details["fused"])
    assert kept == 3 and details["pruned_dropped"] == pairs - kept  # every other pair was pruned to ""
    assert (details["rewrite_unparsed"], details["prune_unparsed"], details["prune_failures"]) == (0, 0, 0)
    assert answer.evidence[0].id == "t/paris#w0" and len({c.id for c in answer.evidence}) == len(answer.evidence)
    prompt = backend.chats[-1]["messages"][-1]["content"]
    assert "Sub-query 1: What is the capital of France?\n[1] Paris: Paris is the capital of France." in prompt
    assert "Sub-query 2: capital of France\n[1] (as above)" in prompt
    assert "Eiffel Tower stands" not in prompt and "Nile" not in prompt  # pruned away
    assert prompt.endswith("Question: What is the capital of France?\nAnswer:")


def test_a_scoped_question_searches_its_documents_chunks_only(tags):
    """Scoped to the Nile document, the capital-of-France question gets the Nile chunk from all three indexes (the
    Paris chunk matches best, and wins unscoped); the pruning and the answer see nothing else."""
    backend = StandIn(prune_and_answer)
    strategy = build(tags)
    answer = strategy.answer("What is the capital of France?", Client(backend), scope=["t/nile"])
    assert answer.failure == "" and [c.id for c in answer.evidence] == ["t/nile#w0"]
    assert answer.details["fused"] == [["t/nile#w0"]] * 3  # the question and its two rewrites
    assert all("Paris is the capital" not in passage(p) for p in backend.chats if schema_name(p) == "pruned")
    opened = strategy.answer("What is the capital of France?", Client(StandIn(prune_and_answer)))
    assert opened.evidence[0].id == "t/paris#w0" and len(opened.evidence) == 2
    with pytest.raises(ConfigError, match="orion.tags has no document t/none"):
        strategy.answer("What is the capital of France?", Client(StandIn(prune_and_answer)), scope=["t/none"])


def test_an_unusable_rewrite_leaves_the_question_alone(tags):
    def replies(payload):
        return "capital, France" if schema_name(payload) == "sub_queries" else prune_and_answer(payload)

    answer = build(tags).answer("What is the capital of France?", Client(StandIn(replies)))
    assert answer.details["sub_queries"] == ["What is the capital of France?"]
    assert answer.details["rewrite_unparsed"] == 1 and answer.details["rewrite_raw"] == "capital, France"
    long_rewrite = json.dumps({"queries": [" ".join(f"w{i}" for i in range(20))]})
    backend = StandIn(lambda p: long_rewrite if schema_name(p) == "sub_queries" else prune_and_answer(p))
    answer = build(tags).answer("q", Client(backend))
    assert answer.details["sub_queries"] == ["q", " ".join(f"w{i}" for i in range(12))]
    schema = backend.chats[0]["response_format"]["json_schema"]["schema"]["properties"]["queries"]
    assert schema["maxItems"] == 3 and schema["items"]["maxLength"] == 120


def test_failed_and_unreadable_pruning_keeps_the_chunk(tags):
    def replies(payload):
        if schema_name(payload) == "pruned" and "Nile" in passage(payload):
            return ClientError(500, "engine crashed")
        if schema_name(payload) == "pruned" and "Alps" in passage(payload):
            return "The Alps, I think"
        return prune_and_answer(payload)

    backend = StandIn(replies)
    answer = build(tags, rewrite_max=0, top_k=3).answer("capital of France", Client(backend))
    assert (answer.details["prune_failures"], answer.details["prune_unparsed"]) == (1, 1)
    assert answer.details["pruned_dropped"] == 0 and answer.prediction == "Paris"
    prompt = backend.chats[-1]["messages"][-1]["content"]
    assert DOCUMENTS[1].text in prompt and DOCUMENTS[2].text in prompt  # kept whole
    assert len(backend.chats) == 3 + 1  # no rewriting call with rewrite_max=0


def test_failed_requests_and_empty_answers_are_recorded(tags):
    def no_answer(payload):
        return ClientError(503, "overloaded") if not schema_name(payload) else prune_and_answer(payload)

    answer = build(tags).answer("What is the capital of France?", Client(StandIn(no_answer)))
    assert answer.failure == "request_failed" and "overloaded" in answer.failure_detail
    assert answer.evidence and answer.evidence[0].id == "t/paris#w0"  # what was retrieved is kept
    answer = build(tags).answer("q", Client(StandIn(lambda p: "" if not schema_name(p) else prune_and_answer(p))))
    assert (answer.failure, answer.prediction) == ("no_answer", "")

    class NoEmbedder(StandIn):
        def post(self, path, payload):
            if path == "/v1/embeddings":
                raise ClientError(0, "connection refused")
            return super().post(path, payload)

    strategy = build(tags)
    answer = strategy.answer("q", Client(NoEmbedder(prune_and_answer)))
    assert answer.failure == "request_failed" and answer.evidence == []


@pytest.mark.parametrize("step, schema", [("query rewrite", "sub_queries"), ("pruning", "pruned"), ("answer", "")])
@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_refused_request_on_the_answer_side_raises_naming_the_step(tags, step, schema, status):
    """A 4xx at any step of a question (a wrong role or model name) would fail every question alike: the strategy
    raises instead of counting a rewrite or pruning failure or recording a failed answer; the pipeline stops."""
    def refuse_one_step(payload):
        if schema_name(payload) == schema:
            return ClientError(status, "no model named 'generator'")
        return prune_and_answer(payload)

    with pytest.raises(RequestRefused, match=rf"Orion-RAG's {step} \(role 'generator'\): .*\(HTTP {status}\)"):
        build(tags).answer("What is the capital of France?", Client(StandIn(refuse_one_step)))

    class RefusingEmbedder(StandIn):  # the index was embedded at build time, through another client
        def post(self, path, payload):
            if path == "/v1/embeddings":
                raise ClientError(status, "no model named 'embedder'")
            return super().post(path, payload)

    strategy = build(tags)
    with pytest.raises(RequestRefused, match=r"Orion-RAG's query embedding \(role 'embedder'\)"):
        strategy.answer("What is the capital of France?", Client(RefusingEmbedder(prune_and_answer)))


def test_a_question_longer_than_the_context_is_cut(tags):
    backend = StandIn(prune_and_answer)
    question = "capital of France " * 400  # 7,200 characters
    answer = build(tags, rewrite_max=0, max_query_chars=300).answer(question, Client(backend))
    assert [len(text) for text in backend.embedded[-1:]] == [300]
    assert answer.details["sub_queries"] == [question[:300]] and answer.prediction == "Paris"
    assert all(len(m["content"]) < 300 + 2000 for chat in backend.chats for m in chat["messages"])


def test_a_corpus_of_one_document(tmp_path):
    folder = write_tags(tmp_path, DOCUMENTS[:1])
    answer = build(folder, top_k=5).answer("What is the capital of France?", Client(StandIn(prune_and_answer)))
    assert [c.id for c in answer.evidence] == ["t/paris#w0"] and answer.prediction == "Paris"


# ------------------------------------------------------------------------------------------------ re-indexing


def test_reindexing_a_document_embeds_its_strings_alone(tags):
    backend = StandIn()
    strategy = build(tags, backend)
    assert backend.embedded[0] == PROBE and len(backend.embedded) == 1 + 2 * 3  # a path and a text per chunk
    before_paths, before_texts = strategy.path_index.embeddings.copy(), strategy.text_index.embeddings.copy()
    backend.embedded.clear()
    edited = DocumentTags("t/alps", "Alps", ["Alps", "Mont Blanc"], "human")
    client = Client(backend)
    assert strategy.reindex_document("t/alps", lambda texts: client.embed("embedder", texts), master=edited) == 1
    assert backend.embedded == ["Alps, Mont Blanc > European mountain range > Alps > alpinism"]
    assert np.array_equal(strategy.path_index.embeddings[:2], before_paths[:2])  # the other documents' rows
    assert not np.array_equal(strategy.path_index.embeddings[2], before_paths[2])
    assert np.array_equal(strategy.text_index.embeddings, before_texts)
    # new chunks for a document: their paths and texts are embedded, the document keeps its place
    backend.embedded.clear()
    new = ChunkTags("t/nile#w0", "t/nile", "Nile", "The Nile flows north.", 0, 21, ["Nile flows north", "Nile",
                                                                                    "geography"], "human")
    assert strategy.reindex_document("t/nile", lambda texts: client.embed("embedder", texts), chunks=[new]) == 2
    assert backend.embedded == ["Nile, Egypt > Nile flows north > Nile > geography", "Nile\nThe Nile flows north."]
    assert [c.text for c in strategy.text_index.chunks][1] == "The Nile flows north."
    assert [cid for cid, _ in strategy.retrieve(["flows north"], client)[0]][0] == "t/nile#w0"
    with pytest.raises(KeyError, match="t/unknown"):
        strategy.reindex_document("t/unknown", lambda texts: client.embed("embedder", texts))


def test_stored_vectors_are_reused_unless_another_embedder_wrote_them(tags):
    build(tags).save_vectors(tags)
    same = StandIn()
    build(tags, same)
    assert same.embedded == [PROBE]
    other = StandIn(other=True)
    build(tags, other)
    assert other.embedded[0] == PROBE and len(other.embedded) == 1 + 2 * 3


def test_a_tag_folder_without_master_tags_is_refused(tmp_path):
    write_tags(tmp_path)
    write_jsonl(tmp_path / MASTERS_FILE, [DocumentTags("t/paris", "Paris", ["Paris"], "llm")])
    with pytest.raises(ConfigError, match="t/nile#w0"):
        build(tmp_path)
    with pytest.raises(ConfigError, match="orion.tags"):
        build(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------------- end to end


def test_the_built_in_models_tag_hotpotqa_documents_and_answer(tmp_path, engines):
    documents, questions = load_corpus("hotpotqa", ROOT / "data" / "hotpotqa")
    question = questions[1]  # two short gold paragraphs (magazines), and a short third one: a chunk each
    picked = [d for d in documents if d.id in [*question.gold_doc_ids, "hotpotqa/the-english-art-of-cookery"]]
    engine = engines(ServeConfig(port=0, roles={
        "generator": RoleConfig(model=SMOLLM2), "embedder": RoleConfig(model=MINILM, kind="embedding")}))
    client = in_process_client(engine)
    report = tag_and_index(picked, client, tmp_path, ChunkingConfig(),
                           TaggingConfig(max_master_tags=2, max_tokens=64, max_attempts=1))
    records = list(read_jsonl(tmp_path / CHUNKS_FILE, ChunkTags))
    expected = [c.id for d in picked for c in chunk_document(d, ChunkingConfig())]
    assert [r.id for r in records] == expected and report["chunks"] == len(expected)
    assert report["tagging"]["llm_calls"] == len(picked) + len(expected)  # one attempt each
    assert report["tagging"]["prompt_tokens"] > 0 and len(expected) < report["index"]["embedded"] <= 2 * len(expected)
    for record in records:
        assert len(record.tags) == 3 and all(1 <= len(t.split()) <= TAG_MAX_WORDS for t in record.tags)
    masters = list(read_jsonl(tmp_path / MASTERS_FILE, DocumentTags))
    assert [m.id for m in masters] == [d.id for d in picked] and all(1 <= len(m.tags) <= 2 for m in masters)
    assert all(1 <= len(t.split()) <= TAG_MAX_WORDS for m in masters for t in m.tags)

    strategy = OrionStrategy.build(client, OrionConfig(tags=str(tmp_path), rewrite_max=1, top_k=1,
                                                       prune_max_tokens=64), AnswerConfig())
    own = client.fork()
    answer = strategy.answer(question.question, own)
    # the in-process engine fails no request (rewrite, pruning or answer), and the model answers
    assert answer.failure == "" and answer.prediction, answer
    assert answer.evidence and all(strategy.chunks[c.id] == c for c in answer.evidence)
    assert {c.doc_id for c in answer.evidence} <= {d.id for d in picked}
    fused = answer.details["fused"]
    assert len(fused) == len(answer.details["sub_queries"]) <= 2 and all(len(ids) == 1 for ids in fused)
    calls = 1 + answer.details["prune_calls"] + 1  # rewrite, one pruning call per (chunk, sub-query), answer
    assert answer.details["prune_calls"] == sum(len(ids) for ids in fused)
    assert own.stats.roles["generator"].requests == calls
