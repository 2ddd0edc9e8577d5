"""The cross-encoder scorer (serving/cross_encoder.py): served scores are CrossEncoder.predict's, in [0, 1] for a
sigmoid model and raw logits for an identity one (each response says which); /score and /rerank answer with vLLM
0.32's shapes; bad requests are BadRequest naming the field; a folder saved with another activation is served as a
400 naming it, through the server's own handlers.

The model is an untrained MiniLM cross-encoder (tests/serving/cross_encoder_fixture.py): these tests check
serving, not ranking quality.
"""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from overstory.serving.client import ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.cross_encoder import (
    CrossEncoderModel,
    RerankRequest,
    ScoreRequest,
    handle_rerank,
    handle_score,
    saved_activation,
)
from overstory.serving.errors import BadRequest
from overstory.serving.in_process import in_process_client

QUERY = "how does a hierarchical retrieval tree route a question"
DOCS = [
    "A tree of summaries lets a scorer descend from coarse sections to fine passages.",
    "Bananas are rich in potassium.",
    "LATTICE scores the children of a node with a language model.",
    "The 1998 season ended with a draw.",
    "retrieval " * 300,  # longer than the model's 512 tokens: truncated, not refused
]
# the keys vLLM 0.32's /score and /v1/rerank answered with, served from a folder built like the fixture's, plus our
# "activation" (probabilities or logits), which a vLLM client ignores
SCORE_KEYS = {"id", "object", "created", "model", "data", "usage", "activation"}
SCORE_USAGE_KEYS = {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                    "completion_tokens_details"}
RERANK_KEYS = {"id", "model", "usage", "results", "activation"}


@pytest.fixture(scope="module")
def folder(cross_encoder_folder: str) -> str:
    return cross_encoder_folder  # the package's (conftest.py), also served by test_scoring_server


@pytest.fixture(scope="module")
def model(folder: str) -> CrossEncoderModel:
    return CrossEncoderModel(folder)


@pytest.fixture(scope="module")
def small(folder: str) -> CrossEncoderModel:
    """Few documents per request and 16 tokens per pair, so both limits are reached by small requests."""
    return CrossEncoderModel(folder, max_documents=3, max_length=16)


@pytest.fixture(scope="module")
def reference(folder: str):
    """A CrossEncoder of its own, as a user would load the folder, for predict() to compare against."""
    from sentence_transformers import CrossEncoder

    return CrossEncoder(folder, device="cpu")


def predict(reference, pairs: list[tuple[str, str]]) -> list[float]:
    return [float(s) for s in reference.predict(pairs, show_progress_bar=False)]


def tokens_after_truncation(reference, queries: list[str], texts: list[str], max_length: int) -> int:
    encoded = reference.tokenizer(queries, texts, truncation=True, max_length=max_length)
    return sum(len(ids) for ids in encoded["input_ids"])


def predict_truncated(folder: str, pairs: list[tuple[str, str]]) -> list[float]:
    from sentence_transformers import CrossEncoder

    return [float(s) for s in CrossEncoder(folder, device="cpu", max_length=16).predict(pairs, show_progress_bar=False)]


@pytest.mark.slow
def test_scores_equal_predict_and_lie_in_unit_interval(model, reference) -> None:
    scores, n_tokens = model.score(QUERY, DOCS)
    expected = predict(reference, [(QUERY, d) for d in DOCS])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert all(0.0 <= s <= 1.0 for s in scores)
    # an untrained head still separates the pairs: a constant (or a dropped text) would not
    assert len({round(s, 6) for s in scores}) == len(DOCS)
    assert n_tokens == tokens_after_truncation(reference, [QUERY] * len(DOCS), DOCS, 512)
    assert isinstance(reference.activation_fn, torch.nn.Sigmoid)  # the fixture's default, which is served


@pytest.mark.slow
def test_token_count_is_after_truncation(small, reference) -> None:
    texts = ["short text", "a much longer text that goes on and on well past sixteen word pieces in total"]
    scores, n_tokens = small.score(QUERY, texts)
    counted = tokens_after_truncation(reference, [QUERY] * 2, texts, 16)
    untruncated = tokens_after_truncation(reference, [QUERY] * 2, texts, 512)
    assert small.max_length == 16
    assert 0 < n_tokens == counted < untruncated  # truncation really happened and was counted
    assert n_tokens <= 2 * 16
    truncated_reference = predict_truncated(small.folder, [(QUERY, t) for t in texts])
    assert scores == pytest.approx(truncated_reference, abs=1e-5)


@pytest.mark.slow
def test_rerank_sorts_by_score_and_cuts_to_top_n(model, reference) -> None:
    expected = predict(reference, [(QUERY, d) for d in DOCS])
    response = handle_rerank(model, RerankRequest(model="scorer", query=QUERY, documents=DOCS, top_n=2))
    json.dumps(response)  # plain JSON types only
    assert set(response) == RERANK_KEYS
    assert response["id"].startswith("score-") and response["model"] == "scorer"
    assert set(response["usage"]) == {"prompt_tokens", "total_tokens"} and response["usage"]["total_tokens"] > 0
    results = response["results"]
    best_two = sorted(range(len(DOCS)), key=lambda i: expected[i], reverse=True)[:2]
    assert [r["index"] for r in results] == best_two
    for r in results:
        assert set(r) == {"index", "document", "relevance_score"}
        assert r["document"] == {"text": DOCS[r["index"]], "multi_modal": None}
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)

    everything = handle_rerank(model, RerankRequest(model="scorer", query=QUERY, documents=DOCS))["results"]
    assert len(everything) == len(DOCS)  # top_n 0: all of them
    assert sorted(r["index"] for r in everything) == list(range(len(DOCS)))
    ranked = [r["relevance_score"] for r in everything]
    assert ranked == sorted(ranked, reverse=True)
    # top_n above the number of documents returns them all, as vLLM does
    assert len(handle_rerank(model, RerankRequest(model="scorer", query=QUERY, documents=DOCS,
                                                  top_n=99))["results"]) == len(DOCS)
    single = handle_rerank(model, RerankRequest(model="scorer", query=QUERY, documents=DOCS[1]))["results"]
    assert [r["index"] for r in single] == [0] and single[0]["document"]["text"] == DOCS[1]


@pytest.mark.slow
def test_score_one_against_n_and_n_against_n(model, reference) -> None:
    one_vs_n = handle_score(model, ScoreRequest(model="scorer", text_1=QUERY, text_2=DOCS[:3]))
    json.dumps(one_vs_n)
    assert set(one_vs_n) == SCORE_KEYS and set(one_vs_n["usage"]) == SCORE_USAGE_KEYS
    assert one_vs_n["object"] == "list" and one_vs_n["id"].startswith("score-")
    assert one_vs_n["usage"]["completion_tokens"] == 0
    assert one_vs_n["usage"]["prompt_tokens"] == one_vs_n["usage"]["total_tokens"] > 0
    assert [d["index"] for d in one_vs_n["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in one_vs_n["data"])
    assert [d["score"] for d in one_vs_n["data"]] == pytest.approx(
        predict(reference, [(QUERY, d) for d in DOCS[:3]]), abs=1e-5)
    # a one-element list of queries is broadcast like a string (vLLM's 1:N)
    listed = handle_score(model, ScoreRequest(model="scorer", data_1=[QUERY], data_2=DOCS[:3]))
    assert [d["score"] for d in listed["data"]] == pytest.approx([d["score"] for d in one_vs_n["data"]], abs=1e-6)

    queries = ["what is a banana", QUERY, "who won in 1998"]
    n_vs_n = handle_score(model, ScoreRequest(model="scorer", queries=queries, documents=DOCS[:3]))
    pairs = list(zip(queries, DOCS[:3]))
    assert [d["score"] for d in n_vs_n["data"]] == pytest.approx(predict(reference, pairs), abs=1e-5)
    assert n_vs_n["usage"]["prompt_tokens"] == tokens_after_truncation(reference, queries, DOCS[:3], 512)
    # a pair scores the same whichever request carries it: N:N really pairs queries[i] with documents[i]
    assert n_vs_n["data"][1]["score"] == pytest.approx(one_vs_n["data"][1]["score"], abs=1e-5)
    items = handle_score(model, ScoreRequest(model="scorer", queries=queries, items=DOCS[:3]))
    assert [d["score"] for d in items["data"]] == pytest.approx([d["score"] for d in n_vs_n["data"]], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("call", "param"), [
    (lambda m: m.score(QUERY, []), "documents"),
    (lambda m: m.score("", DOCS[:2]), "query"),
    (lambda m: m.score("   ", DOCS[:2]), "query"),
    (lambda m: m.score(QUERY, ["a", "b", "c", "d"]), "documents"),  # more than max_documents=3
    (lambda m: handle_rerank(m, RerankRequest(model="s", query=QUERY, documents=[])), "documents"),
    (lambda m: handle_rerank(m, RerankRequest(model="s", query="", documents=DOCS[:2])), "query"),
    (lambda m: handle_rerank(m, RerankRequest(model="s", query=QUERY, documents=["a"] * 4)), "documents"),
    (lambda m: handle_score(m, ScoreRequest(model="s", queries=["a", "b"], documents=["x", "y", "z"])),
     "documents"),
    (lambda m: handle_score(m, ScoreRequest(model="s", text_1=["a", "b"], text_2="x")), "text_2"),
    (lambda m: handle_score(m, ScoreRequest(model="s", text_1=QUERY, text_2=[])), "text_2"),
    (lambda m: handle_score(m, ScoreRequest(model="s", data_1=[], data_2=["x"])), "data_1"),
    (lambda m: handle_score(m, ScoreRequest(model="s", queries=["a", ""], documents=["x", "y"])), "queries"),
    (lambda m: handle_score(m, ScoreRequest(model="s", text_1="", text_2="x")), "text_1"),
    (lambda m: handle_score(m, ScoreRequest(model="s", text_1=QUERY, text_2=["x"] * 4)), "text_2"),
])
def test_bad_requests_name_the_field(small, call, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        call(small)
    assert caught.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"use_activation": False}, "use_activation"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"max_tokens_per_query": 4}, "max_tokens_per_query"),
    ({"max_tokens_per_doc": 4}, "max_tokens_per_doc"),
])
def test_score_changing_vllm_options_are_refused(fields: dict, param: str) -> None:
    for request in (ScoreRequest(model="s", text_1="q", text_2="x", **fields),
                    RerankRequest(model="s", query="q", documents=["x"], **fields)):
        with pytest.raises(BadRequest) as caught:
            request.check_supported()
        assert caught.value.param == param
    # their defaults, and vLLM's -1 ("the model's maximum"), are what the scorer does anyway
    ScoreRequest(model="s", text_1="q", text_2="x", use_activation=True, truncate_prompt_tokens=-1).check_supported()


@pytest.mark.parametrize("body", [
    {"model": "s"},  # no field pair
    {"model": "s", "text_1": "q"},  # half a pair
    {"model": "s", "text_1": "q", "text_2": "x", "queries": "q", "documents": "x"},  # two pairs: ambiguous
    {"text_1": "q", "text_2": "x"},  # the model names the role
])
def test_score_request_needs_exactly_one_field_pair(body: dict) -> None:
    with pytest.raises(ValidationError):
        ScoreRequest(**body)


def test_score_request_reports_the_fields_it_used() -> None:
    assert ScoreRequest(model="s", queries="q", items=["x"]).fields == ("queries", "items")
    assert ScoreRequest(model="s", text_1="q", text_2=["x"]).fields == ("text_1", "text_2")
    with pytest.raises(ValidationError):
        RerankRequest(model="s", query="q", documents=["x"], top_n=-1)


def _resaved(folder: str, out, activation: torch.nn.Module) -> str:
    """The fixture's model saved again with another activation (the weights, so the logits, are the same)."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(folder, device="cpu", activation_fn=activation).save(str(out))
    return str(out)


@pytest.mark.slow
def test_an_identity_model_serves_raw_logits_and_says_so(folder, reference, tmp_path) -> None:
    logits_folder = _resaved(folder, tmp_path / "logits", torch.nn.Identity())
    model = CrossEncoderModel(logits_folder)
    assert (model.activation, saved_activation(logits_folder), saved_activation(folder)) == (
        "identity", "identity", "sigmoid")
    response = handle_score(model, ScoreRequest(model="s", queries=QUERY, documents=DOCS[:4]))
    logits = [d["score"] for d in response["data"]]
    assert response["activation"] == "identity"
    # the sigmoid model's probabilities are the sigmoid of these very logits: same weights, only the head's reading
    assert torch.sigmoid(torch.tensor(logits)).tolist() == pytest.approx(predict(reference, [(QUERY, d) for d in
                                                                                           DOCS[:4]]), abs=1e-5)
    rerank = handle_rerank(model, RerankRequest(model="s", query=QUERY, documents=DOCS[:4]))
    assert rerank["activation"] == "identity" and [r["relevance_score"] for r in rerank["results"]] == sorted(
        logits, reverse=True)
    # raw logits are what this model serves anyway, so vLLM's use_activation=false is honoured, not refused
    handle_score(model, ScoreRequest(model="s", text_1=QUERY, text_2=DOCS[0], use_activation=False))
    assert handle_score(CrossEncoderModel(folder), ScoreRequest(model="s", text_1=QUERY, text_2=DOCS[0]))[
        "activation"] == "sigmoid"


@pytest.mark.slow
def test_an_unknown_activation_is_a_400_naming_it(folder, tmp_path, engines, caplog) -> None:
    """A folder saved with a tanh: the load logs an error naming it, and a request to the role gets a 400 (through
    the server's own handlers) naming it, on /score and /v1/rerank alike; eval lattice reads it from the folder."""
    tanh_folder = _resaved(folder, tmp_path / "tanh", torch.nn.Tanh())
    with caplog.at_level("ERROR", logger="overstory.serving.cross_encoder"):
        engine = engines(ServeConfig(port=0, roles={"scorer": RoleConfig(model=tanh_folder, kind="cross-encoder")}))
    assert "activation Tanh is not served" in caplog.text
    client = in_process_client(engine)
    for call in (lambda: client.score("scorer", QUERY, DOCS[:2]), lambda: client.rerank("scorer", QUERY, DOCS[:2])):
        with pytest.raises(ClientError) as refused:
            call()
        assert refused.value.status == 400 and "activation Tanh is not served" in str(refused.value)
    with pytest.raises(ValueError, match="activation Tanh is not served"):
        saved_activation(tanh_folder)
