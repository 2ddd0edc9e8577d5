"""A cross-encoder ``scorer`` role through the server: vLLM's ``/score`` and ``/v1/rerank`` over HTTP, our client's
``score`` / ``rerank`` with their accounting, and the document limit. The cross-encoder is the untrained MiniLM one
of ``cross_encoder_fixture``, the package's folder (conftest.py): serving is checked, not ranking quality."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from sentence_transformers import CrossEncoder

from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import serve_in_background
from tests.serving.metrics_page import parse, value

pytestmark = pytest.mark.slow

QUERY = "Where is the Eiffel Tower?"
DOCS = ["The Eiffel Tower stands in Paris.", "Bananas are yellow.", "Paris is the capital of France.",
        "The tower was finished in 1889."]


@pytest.fixture(scope="module")
def scorer(cross_encoder_folder: str) -> tuple[str, str]:
    folder = cross_encoder_folder  # the package's (conftest.py)
    config = ServeConfig(port=0, roles={"scorer": RoleConfig(model=folder, kind="cross-encoder", max_documents=5)})
    with serve_in_background(config) as url:
        yield url, folder


def _scorer_successes(url: str) -> float:
    """The server's ``request_success_total`` for the scorer role (finished reason stop), from its /metrics page."""
    return value(parse(httpx.get(f"{url}/metrics").text), "overstory:request_success_total", model_name="scorer",
                 finished_reason="stop") or 0.0


def test_client_scores_equal_predict_in_process(scorer) -> None:
    url, folder = scorer
    expected = CrossEncoder(folder, device="cpu").predict([(QUERY, d) for d in DOCS])
    client = Client.from_url(url)
    before = _scorer_successes(url)
    scores = client.score("scorer", QUERY, DOCS)
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    ranked = client.rerank("scorer", QUERY, DOCS, top_n=2)
    assert [i for i, _ in ranked] == list(np.argsort(-expected, kind="stable")[:2])
    stats = client.stats.summary()["scorer"]
    assert stats["requests"] == 2 and stats["prompt_tokens"] > 0
    # the server counts one finished engine request per pair scored, as vLLM does; top_n cuts no pair
    assert _scorer_successes(url) - before == len(DOCS) * 2


def test_vllm_shapes_over_http(scorer) -> None:
    url, _ = scorer
    score = httpx.post(f"{url}/v1/score", json={"model": "scorer", "text_1": QUERY, "text_2": DOCS[:2]}).json()
    assert score["object"] == "list" and [d["index"] for d in score["data"]] == [0, 1]
    rerank = httpx.post(f"{url}/v1/rerank", json={"model": "scorer", "query": QUERY, "documents": DOCS}).json()
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert rerank["results"][0]["document"]["text"] in DOCS


def test_scoring_limits_and_wrong_roles(scorer) -> None:
    url, _ = scorer
    client = Client.from_url(url, max_retries=0)
    with pytest.raises(ClientError) as too_many:
        client.rerank("scorer", QUERY, DOCS * 2)
    assert too_many.value.status == 400 and "5" in too_many.value.reason
    with pytest.raises(ClientError) as empty:
        client.score("scorer", QUERY, [])
    assert empty.value.status == 400
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "scorer", "messages": [
        {"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "not a chat model" in chat.json()["error"]["message"]
