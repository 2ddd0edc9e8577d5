"""The ``cross-encoder`` scorer: a sentence-transformers ``CrossEncoder`` folder served behind vLLM's
``/score`` and ``/v1/rerank`` request and response shapes, so that a client written against vLLM's
scoring API works unchanged against the embedded server.

Why a cross-encoder: a LATTICE-style scorer that reads the query and a candidate together ranks better
than comparing two independent embeddings, and one forward pass per pair is far cheaper than asking a
chat model for a judgement.

Scores are what ``CrossEncoder(folder).predict(pairs)`` returns with the model's own saved activation, one of
``ACTIVATIONS``: a sigmoid gives relevance probabilities in [0, 1] (what a pointwise, binary cross-entropy model is
read as); an identity gives the raw logits, which sentence-transformers recommends for listwise losses (ListNet,
LambdaLoss: a sigmoid saturates and flattens the ranking they learn). Every response says which in an
``activation`` field (an extra key beside vLLM's, which a vLLM client ignores), so a consumer knows whether it
holds probabilities or logits. A folder saved with any other activation (a tanh, a softmax) is logged as an error
at load and every request naming it is answered with a 400 that names the activation: its scores would mean
something no consumer here expects. A non-finite score (a broken checkpoint) is an error, never a ranking.
Pairs longer than the model's ``max_seq_length`` are truncated exactly as ``predict`` truncates them
(``longest_first``); vLLM would refuse them instead.

Shapes follow vLLM 0.32.0, ``vllm/entrypoints/pooling/scoring/protocol.py`` (request and response models),
``scoring/serving.py`` (how responses are filled) and ``scoring/utils.py`` (which length pairings are
allowed). Differences, on purpose: ``model`` is required because it names the role on the embedded server;
text inputs only (no multimodal content parts); vLLM knobs that would change scores (``use_activation=false``,
``truncate_prompt_tokens``, ``max_tokens_per_query``, ``max_tokens_per_doc``) are refused, not ignored.

Wiring (serving/engine.py, server.py): build one ``CrossEncoderModel(folder)`` per role, then route
``POST /score`` (and ``/v1/score``) to ``handle_score`` and ``POST /rerank``, ``/v1/rerank`` (and ``/v2/rerank``)
to ``handle_rerank``; both raise ``BadRequest`` with ``param`` set, which the server maps to a 400.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, model_validator

from overstory.serving.errors import BadRequest
from overstory.serving.model_thread import ModelThread
from overstory.serving.protocol import StrictRequest, label, refused

logger = logging.getLogger(__name__)

# The activations served, by the name responses give them: what each makes of the model's one logit
ACTIVATIONS: dict[type[torch.nn.Module], str] = {torch.nn.Sigmoid: "sigmoid", torch.nn.Identity: "identity"}

# The four spellings of a /score request vLLM accepts (one pydantic model each there), in the order its
# request union tries them: first field holds the queries, second the texts they are scored against.
SCORE_FIELD_PAIRS: tuple[tuple[str, str], ...] = (
    ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class CrossEncoderModel:
    """A sentence-transformers ``CrossEncoder`` on CPU with one label, scoring (query, text) pairs.

    ``max_documents`` caps the pairs of one request (a request is scored in one call, on the model's own thread);
    ``max_length`` overrides the model's ``max_seq_length`` (tokens per pair, query and text together)."""

    def __init__(self, folder: str, max_documents: int = 1000, max_length: int | None = None):
        from sentence_transformers import CrossEncoder

        if max_documents < 1:
            raise ValueError(f"max_documents must be positive, got {max_documents}")
        self.folder = folder
        self.max_documents = max_documents
        self.encoder = CrossEncoder(folder, device="cpu", max_length=max_length)
        if self.encoder.num_labels != 1:
            raise ValueError(f"{folder}: a scorer needs a one-label cross-encoder (one relevance score per pair), "
                             f"this one has {self.encoder.num_labels} labels")
        # "": served; else the refusal every request naming the model gets (a 400 naming the activation)
        self.activation, self.refusal = activation_name(self.encoder.activation_fn), ""
        if not self.activation:
            self.refusal = unknown_activation_message(folder, self.encoder.activation_fn)
            logger.error("%s", self.refusal)
        # its forward passes on a thread of its own, one at a time (model_thread.py says why)
        self.thread = ModelThread(folder)

    def require_served(self) -> None:
        """Raise the 400 naming the model's activation when it is not one of ``ACTIVATIONS``."""
        if self.refusal:
            raise BadRequest(self.refusal, param="model")

    @property
    def max_length(self) -> int:
        """Tokens per pair (query, text and special tokens) after truncation."""
        return int(self.encoder.max_seq_length)

    def score(self, query: str, texts: list[str], *, query_param: str = "query",
              texts_param: str = "documents") -> tuple[list[float], int]:
        """Scores in [0, 1] of ``query`` against each text, in the texts' order, and the number of tokens
        actually scored (after truncation). ``query_param``/``texts_param`` name the request fields that
        errors point at."""
        if not texts:
            raise BadRequest("at least one text to score is needed", param=texts_param)
        return self.score_pairs([query] * len(texts), list(texts), query_param=query_param, texts_param=texts_param)

    def score_pairs(self, queries: list[str], texts: list[str], *, query_param: str = "text_1",
                    texts_param: str = "text_2") -> tuple[list[float], int]:
        """Scores (probabilities or logits: ``activation``) of ``queries[i]`` against ``texts[i]``, and the number of
        tokens scored."""
        self.require_served()
        if len(queries) != len(texts):
            raise BadRequest(f"{len(queries)} queries but {len(texts)} texts: pairs need as many of each",
                             param=texts_param)
        if not texts:
            raise BadRequest("at least one text to score is needed", param=texts_param)
        if len(texts) > self.max_documents:
            raise BadRequest(f"{len(texts)} texts to score; this scorer takes at most {self.max_documents} "
                             "per request", param=texts_param)
        # an empty query scores every text against nothing: almost surely a caller bug, not a question
        if any(not q.strip() for q in queries):
            raise BadRequest("the query is empty", param=query_param)
        pairs = list(zip(queries, texts))
        # the same preprocessing predict runs, so the count is of the tokens the model saw
        scores, features = self.thread.run(lambda: (
            self.encoder.predict(pairs, convert_to_numpy=True, show_progress_bar=False),
            self.encoder.preprocess(pairs)))
        n_tokens = int(features["attention_mask"].sum())
        values = [float(s) for s in scores]
        # a sigmoid cannot leave [0, 1] and a logit is finite; NaN is neither (a broken checkpoint) and must not
        # reach a ranking
        valid = (lambda v: 0.0 <= v <= 1.0) if self.activation == "sigmoid" else math.isfinite
        if not all(valid(v) for v in values):
            raise RuntimeError(f"{self.folder}: invalid {self.activation} scores: {values[:5]}")
        return values, n_tokens


def activation_name(activation: object) -> str:
    """The served name of a loaded cross-encoder's activation (``ACTIVATIONS``), "" for one not served."""
    return next((name for kind, name in ACTIVATIONS.items() if isinstance(activation, kind)), "")


def unknown_activation_message(folder: str, activation: object) -> str:
    """Why a folder's activation is not served, naming it and the fix."""
    return (f"{folder}: the cross-encoder's activation {type(activation).__name__} is not served (served: "
            f"{', '.join(f'torch.nn.{kind.__name__}' for kind in ACTIVATIONS)}); re-save it with "
            "CrossEncoder(..., activation_fn=torch.nn.Sigmoid()) or torch.nn.Identity()")


def saved_activation(folder: str | Path) -> str:
    """The activation a CrossEncoder folder was saved with, by its served name (``ACTIVATIONS``), read from the
    files without loading the model, as sentence-transformers reads them: ``config_sentence_transformers.json``'s
    ``activation_fn`` (v4 and later), else ``config.json``'s ``sentence_transformers.activation_fn`` or
    ``sbert_ce_default_activation_function`` (older folders), else its default for one label, a sigmoid. Raises
    ValueError naming an activation that is not served, so a consumer never reads logits as probabilities."""
    folder = Path(folder)
    path = ""
    st_config = folder / "config_sentence_transformers.json"
    if st_config.exists():
        path = json.loads(st_config.read_text()).get("activation_fn") or ""
    if not path and (folder / "config.json").exists():
        config = json.loads((folder / "config.json").read_text())
        path = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
            "sbert_ce_default_activation_function") or ""
    name = path.rsplit(".", 1)[-1] if path else "Sigmoid"
    served = {kind.__name__: served_name for kind, served_name in ACTIVATIONS.items()}
    if name not in served:
        raise ValueError(f"{folder}: the cross-encoder's activation {name} is not served (served: "
                         f"{', '.join(served)})")
    return served[name]


def _request_id() -> str:
    # vLLM's random_uuid(): 16 hex characters
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


class _ScoringRequest(StrictRequest):
    """What vLLM's ``ScoringRequestMixin`` carries that the embedded scorer honours or must refuse; a field
    in neither schema gets OpenAI's "Unrecognized request argument" 400 (``serving/protocol.py``)."""

    model: str
    user: str | None = label()
    cache_salt: str | None = label()  # salts vLLM's prefix cache; nothing is cached across requests here
    priority: Any = refused("the embedded engine schedules requests first come, first served", 0)
    instruction: Any = refused("pairs are scored as the cross-encoder was trained, without an instruction")
    chat_template_kwargs: Any = refused("a cross-encoder reads the pair without a chat template", {})
    mm_processor_kwargs: Any = refused("text-only models", {})
    padding: Any = refused("pairs are padded per batch by sentence-transformers")
    truncation_side: Any = refused("pairs are truncated longest-first, as CrossEncoder.predict does")
    request_id: str = Field(default_factory=_request_id)  # becomes the response id, "score-<request_id>"
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0

    def check_supported(self, activation: str = "sigmoid") -> None:
        """Refuse what the model serving the request (its ``activation``) cannot honour."""
        # raw logits are what an identity model serves anyway; a sigmoid model serves probabilities only
        if self.use_activation is False and activation != "identity":
            raise BadRequest("use_activation=false (raw logits) is not served by this sigmoid model; its scores are "
                             "probabilities in [0, 1]", param="use_activation")
        # -1 is vLLM's "truncate to the model's maximum", which is what the scorer always does
        if self.truncate_prompt_tokens not in (None, -1):
            raise BadRequest("truncate_prompt_tokens is not supported; pairs are truncated to the model's "
                             "max_seq_length", param="truncate_prompt_tokens")
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported; pairs are truncated to the model's max_seq_length",
                                 param=name)


class ScoreRequest(_ScoringRequest):
    """vLLM's ``/score`` request: queries and the texts to score them against, under one of four field
    pairs (``queries``/``documents``, ``queries``/``items``, ``data_1``/``data_2``, ``text_1``/``text_2``).
    Each side is a string or a list; 1 query scores against N texts, N queries against N texts pairwise."""

    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None

    @model_validator(mode="after")
    def _one_field_pair(self) -> ScoreRequest:
        given = [pair for pair in SCORE_FIELD_PAIRS if getattr(self, pair[0]) is not None
                 and getattr(self, pair[1]) is not None]
        if len(given) != 1:
            names = ", ".join(f"{a}/{b}" for a, b in SCORE_FIELD_PAIRS)
            raise ValueError(f"give exactly one pair of fields: {names}")
        return self

    @property
    def fields(self) -> tuple[str, str]:
        """The (queries, texts) field names this request used."""
        return next(pair for pair in SCORE_FIELD_PAIRS
                    if getattr(self, pair[0]) is not None and getattr(self, pair[1]) is not None)


class RerankRequest(_ScoringRequest):
    """vLLM's ``/rerank`` request (Jina/Cohere style): one query, documents, and ``top_n`` (0: all)."""

    query: str
    documents: str | list[str]
    top_n: int = Field(default=0, ge=0)


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def handle_score(model: CrossEncoderModel, request: ScoreRequest) -> dict[str, Any]:
    """vLLM 0.32's ``ScoreResponse``: ``{"id": "score-…", "object": "list", "created", "model",
    "data": [{"index", "object": "score", "score"}], "usage": {"prompt_tokens", "total_tokens",
    "completion_tokens": 0, "prompt_tokens_details": null, "completion_tokens_details": null},
    "activation": "sigmoid" | "identity"}``, one entry per pair in request order (``activation``, our extra key:
    scores are probabilities or raw logits)."""
    model.require_served()
    request.check_supported(model.activation)
    first, second = request.fields
    queries, texts = _as_list(getattr(request, first)), _as_list(getattr(request, second))
    # vLLM's _validate_score_input_lens: 1:1, 1:N or N:N, nothing else
    if not queries:
        raise BadRequest("at least one query must be given", param=first)
    if not texts:
        raise BadRequest("at least one text to score must be given", param=second)
    if len(queries) > 1 and len(queries) != len(texts):
        raise BadRequest(f"{len(queries)} {first} against {len(texts)} {second}: lengths must be 1:1, 1:N or N:N",
                         param=second)
    if len(queries) == 1:
        queries = queries * len(texts)
    scores, n_tokens = model.score_pairs(queries, texts, query_param=first, texts_param=second)
    return {
        "id": f"score-{request.request_id}", "object": "list", "created": int(time.time()), "model": request.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None, "completion_tokens_details": None},
        "activation": model.activation,
    }


def handle_rerank(model: CrossEncoderModel, request: RerankRequest) -> dict[str, Any]:
    """vLLM 0.32's ``RerankResponse``: ``{"id": "score-…", "model", "usage": {"prompt_tokens",
    "total_tokens"}, "results": [{"index", "document": {"text", "multi_modal": null}, "relevance_score"}]}``,
    results sorted by score (highest first; ties keep document order) and cut to ``top_n`` when it is
    positive and below the number of documents. ``index`` is the document's position in the request;
    ``activation`` as in ``handle_score``."""
    model.require_served()
    request.check_supported(model.activation)
    documents = _as_list(request.documents)
    scores, n_tokens = model.score(request.query, documents, query_param="query", texts_param="documents")
    results = [{"index": i, "document": {"text": doc, "multi_modal": None}, "relevance_score": s}
               for i, (doc, s) in enumerate(zip(documents, scores))]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable, as vLLM's list.sort
    top_n = request.top_n or len(results)
    return {
        "id": f"score-{request.request_id}", "model": request.model,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        "results": results[:top_n],
        "activation": model.activation,
    }
