"""LATTICE's cross-encoder scorer reads the activation the server reports with its scores: a real identity
(raw-logit) cross-encoder served by the embedded engine is read as logits without being told, in the search and in
the harness's LATTICE strategy; a setting that contradicts the report is refused naming both; a server that does not
report (vLLM's /score) needs the setting.

The cross-encoder is MiniLM's body with a new, untrained one-label head (``tests/serving/cross_encoder_fixture.py``
says why no pretrained one is used): these tests check how scores are read, never ranking quality.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy.special import expit

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.models.registry import MINILM, SMOLLM2, init_cross_encoder
from overstory.retrieval.answer import AnswerConfig
from overstory.retrieval.lattice.scorers import CrossEncoderSlateScorer, Slate
from overstory.retrieval.lattice.search import SearchConfig
from overstory.retrieval.lattice.strategy import LatticeStrategy, LatticeStrategyConfig
from overstory.retrieval.lattice.tree import Node, Tree
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.in_process import in_process_client

QUERY = "Which city hosted the 1936 Summer Olympics?"
TEXTS = ["The 1936 Summer Olympics were held in Berlin, Germany.", "Bananas are rich in potassium.",
         "Jesse Owens won four gold medals at the Berlin games."]


def _cross_encoder(folder: Path, activation: torch.nn.Module) -> str:
    """An untrained one-label MiniLM cross-encoder saved with ``activation`` into ``folder``."""
    model = init_cross_encoder(MINILM, seed=0)
    model.activation_fn = activation
    model.save(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def identity_folder(tmp_path_factory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("ce") / "identity", torch.nn.Identity())


@pytest.fixture(scope="module")
def sigmoid_folder(tmp_path_factory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("ce") / "sigmoid", torch.nn.Sigmoid())


def _served(engines, folder: str, **roles: RoleConfig) -> Client:
    config = ServeConfig(port=0, roles={"scorer": RoleConfig(model=folder, kind="cross-encoder"), **roles})
    return in_process_client(engines(config))


def _slate() -> Slate:
    return Slate("q", QUERY, ["a", "b", "c"], TEXTS, True)


def test_the_scorer_reads_logits_as_the_server_reports_them(engines, identity_folder, sigmoid_folder):
    """The identity model's /score and /v1/rerank results say ``identity``; a scorer told nothing maps the logits
    through a sigmoid (in order); told ``sigmoid``, it refuses naming both. The sigmoid model's say ``sigmoid``, are
    scaled as probabilities, and a scorer told ``identity`` is refused."""
    client = _served(engines, identity_folder)
    logits = client.score("scorer", QUERY, TEXTS)
    reranked = client.rerank("scorer", QUERY, TEXTS)
    assert logits.activation == reranked.activation == "identity"
    assert sorted(reranked, key=lambda pair: pair[0]) == [(i, v) for i, v in enumerate(logits)]
    (reply,) = CrossEncoderSlateScorer(client).score([_slate()])
    assert reply.parsed and list(reply.scores.values()) == pytest.approx([100 * expit(v) for v in logits])
    assert CrossEncoderSlateScorer(client, activation="identity").score([_slate()])[0].scores == reply.scores
    with pytest.raises(ConfigError, match=r"serves identity scores \(raw logits\).*told activation='sigmoid'.*set "
                                          r"activation='identity'"):
        CrossEncoderSlateScorer(client, activation="sigmoid").score([_slate()])

    client = _served(engines, sigmoid_folder)
    probabilities = client.score("scorer", QUERY, TEXTS)
    assert probabilities.activation == "sigmoid" and all(0 <= p <= 1 for p in probabilities)
    (reply,) = CrossEncoderSlateScorer(client).score([_slate()])
    assert list(reply.scores.values()) == pytest.approx([100 * p for p in probabilities])
    with pytest.raises(ConfigError, match=r"serves sigmoid scores \(probabilities\).*told activation='identity'"):
        CrossEncoderSlateScorer(client, activation="identity").score([_slate()])


class WithoutActivation:
    """The embedded server's backend with the ``activation`` key taken out of every response: /score as vLLM 0.32
    answers it (its ScoreResponse has no such field). vLLM's CPU build does not serve this cross-encoder here, so the
    real model's reply is reshaped instead. ``offset`` is added to each score: logits above 1, as a trained model's
    often are (this untrained head's sit near 0)."""

    def __init__(self, backend, offset: float = 0.0):
        self.backend, self.offset = backend, offset

    def post(self, path, payload):
        response, retries = self.backend.post(path, payload)
        response = {k: v for k, v in response.items() if k != "activation"}
        if path == "/score":
            response["data"] = [{**row, "score": row["score"] + self.offset} for row in response["data"]]
        return response, retries

    def get(self, path):
        return self.backend.get(path)

    def close(self):
        self.backend.close()


def test_a_server_that_does_not_report_needs_the_setting(engines, identity_folder):
    """Without a report the scorer cannot tell logits from probabilities: told nothing, it asks for the setting;
    told ``identity``, it maps the logits as with a report; told ``sigmoid``, logits outside [0, 1] are refused."""
    served = _served(engines, identity_folder)
    client = Client(WithoutActivation(served.backend))
    logits = client.score("scorer", QUERY, TEXTS)
    assert logits.activation is None and list(logits) == pytest.approx(served.score("scorer", QUERY, TEXTS))
    with pytest.raises(ConfigError, match=r"does not say whether its scores are probabilities or raw logits"):
        CrossEncoderSlateScorer(client).score([_slate()])
    (reply,) = CrossEncoderSlateScorer(client, activation="identity").score([_slate()])
    assert list(reply.scores.values()) == pytest.approx([100 * expit(v) for v in logits])
    shifted = Client(WithoutActivation(served.backend, offset=2.0))
    with pytest.raises(ConfigError, match=r"outside \[0, 1\].*set the activation to 'identity'"):
        CrossEncoderSlateScorer(shifted, activation="sigmoid").score([_slate()])


def _tree() -> tuple[Tree, list[Chunk]]:
    """root -> (sport: a, c), (food: b): the three texts as leaves of one document."""
    nodes = {"root": Node("root", children=["sport", "food"]),
             "sport": Node("sport", name="Olympic games", children=["a", "c"]),
             "food": Node("food", name="Fruit", children=["b"])}
    leaves = dict(zip("abc", TEXTS, strict=True))
    nodes.update({i: Node(i, leaf=True, text=t, doc_id="d") for i, t in leaves.items()})
    chunks = [Chunk(i, "d", "paragraph", t, None, [], 0, len(t), 2) for i, t in leaves.items()]
    return Tree("root", nodes), chunks


def test_the_lattice_strategy_answers_with_an_identity_student_untold(engines, identity_folder):
    """The harness's LATTICE strategy with ``scorer: cross_encoder`` and no activation setting (eval pipeline's
    default) searches with the identity model's logits and answers with the real SmolLM2 generator; a contradicting
    setting stops the question with the ConfigError."""
    client = _served(engines, identity_folder, generator=RoleConfig(model=SMOLLM2))
    tree, chunks = _tree()
    config = LatticeStrategyConfig(scorer="cross_encoder", search=SearchConfig(iterations=2, top_k=3))
    assert config.cross_encoder_activation == ""
    answer = LatticeStrategy(tree, chunks, config, AnswerConfig(max_tokens=8)).answer(QUERY, client)
    assert answer.failure == "" and answer.raw
    assert answer.details["slates"] >= 2 and answer.details["failed_slates"] == 0
    assert {c.id for c in answer.evidence} == {"a", "b", "c"}
    told = LatticeStrategyConfig(scorer="cross_encoder", cross_encoder_activation="sigmoid",
                                 search=SearchConfig(iterations=2, top_k=3))
    with pytest.raises(ConfigError, match="told activation='sigmoid'"):
        LatticeStrategy(tree, chunks, told, AnswerConfig(max_tokens=8)).answer(QUERY, client)
