"""Slate scorers the LATTICE search can call: a served LLM (listwise JSON), a served cross-encoder, an oracle.

Each takes a batch of slates (from every query of a lockstep iteration) and returns one ``SlateScore``
per slate with scores 0-100 by slate position, the reply's reasoning and raw text, and its cost (calls,
tokens from the server's ``usage``, seconds). The LLM scorer sends a batch's slates concurrently, so a
batching server (vLLM, the embedded engine) sees them together.

A request that fails for a transient reason (a timeout, the server down, a 5xx, 408 or 429: ``transient``) leaves a
failed slate, its error in ``SlateScore.failure``, so a rerun of the traces job asks again; a request the server
refuses for good (any other 4xx: a wrong role or model name, a bad request) raises ``RequestRefused``, since every
slate would fail the same way and a search of failed slates still ranks, from no scores at all.

Two more ways a slate's reply is cut short, counted in ``SlateScore.problems`` (which the search sums per query, the
traces job writes per question and ``eval lattice`` shows beside its failed slates, both being repairs):

* ``reply_truncated``: a reply the server stopped at ``max_tokens`` (finish_reason "length") inside its JSON. Its
  complete ``[id, score]`` pairs are kept (``parse_truncated_reply``); the candidates it never reached are missing,
  as in any damaged reply. Asking again at temperature 0 would cut at the same place, so a truncated reply with
  scores is kept, not retried.
* ``prompt_too_long_failed``: a slate whose prompt plus ``max_tokens`` exceeds the scorer's context. It is not sent
  (the server would refuse it with a 400, and a refusal stops the whole search); it becomes a failed slate, unparsed
  and without scores, as a reply without usable scores does, with ``failure`` empty since asking again cannot help.
  The context is the role's ``max_model_len`` in ``/v1/models`` (vLLM and the embedded server list it; a LoRA
  module's is its base model's), read once; the prompt's length is counted by the server's ``/tokenize`` with the
  same chat messages, so the count is the served tokenizer's and chat template's, exact, not an estimate that would
  refuse slates that fit or send ones that do not. A server that lists no ``max_model_len`` is not checked (it
  enforces its own limit).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Protocol

from scipy.special import expit

from overstory.core.config import ConfigError
from overstory.models.scorer import SlateParse, parse_slate_reply, slate_prompt, slate_response_format
from overstory.retrieval.lattice.tree import Tree
from overstory.retrieval.strategy import raise_if_refused
from overstory.serving.client import Client, ClientError


@dataclass(frozen=True)
class Slate:
    """What one scorer call rates: a query and candidate nodes (texts as the scorer sees them)."""

    query_id: str
    query: str
    node_ids: list[str]
    texts: list[str]
    leaf: bool


@dataclass
class SlateScore:
    """A scorer's answer for one slate; ``scores`` keys are slate positions, values 0-100. ``failure`` is "" when the
    slate's last request got a reply (usable or not), else that request's transient error: the slate is lost to a
    request failure and worth asking again."""

    scores: dict[int, float]
    reasoning: str = ""
    raw: str = ""
    parsed: bool = True
    problems: dict[str, int] = field(default_factory=dict)
    calls: int = 1
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    failure: str = ""


class SlateScorer(Protocol):
    """Anything that scores slates. ``listwise`` scorers see a slate together, so their scores carry a
    slate bias that calibration removes; pointwise ones (a cross-encoder, the oracle) do not."""

    listwise: bool

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]: ...


class LLMSlateScorer:
    """Listwise scoring by the served ``role`` (the teacher, or the distilled LoRA student) through
    grammar-constrained JSON; a reply without usable scores, or a transient request failure, is asked again up to
    ``max_attempts`` times, then kept as a failed slate with its raw text (and the request's error in ``failure``
    when the last try failed that way). A refused request raises ``RequestRefused``."""

    listwise = True

    def __init__(self, client: Client, role: str = "scorer", max_tokens: int = 384, temperature: float = 0.0,
                 max_attempts: int = 2, concurrency: int = 8, max_candidate_chars: int = 600,
                 max_reasoning_chars: int = 400):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.client, self.role = client, role
        self.max_tokens, self.temperature = max_tokens, temperature
        self.max_attempts, self.concurrency = max_attempts, concurrency
        self.max_candidate_chars, self.max_reasoning_chars = max_candidate_chars, max_reasoning_chars
        self._context: int | None = None
        self._context_read, self._context_lock = False, threading.Lock()

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]:
        if not slates:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(slates)))) as pool:
            return list(pool.map(self._score_one, slates))

    def _score_one(self, slate: Slate) -> SlateScore:
        prompt = slate_prompt(slate.query, slate.texts, slate.leaf, max_chars=self.max_candidate_chars)
        messages = [{"role": "user", "content": prompt}]
        total = SlateScore(scores={}, parsed=False, calls=0)
        started = time.perf_counter()
        try:
            too_long = self._too_long(messages)
        except ClientError as exc:
            raise_if_refused(exc, f"LATTICE's slate scorer (role {self.role!r}), counting a slate's prompt tokens")
            total.raw, total.failure = f"<request failed: {exc}>", str(exc)
            total.seconds = time.perf_counter() - started
            return total
        if too_long:
            total.raw, total.problems = too_long, {"missing": len(slate.texts), "prompt_too_long_failed": 1}
            total.seconds = time.perf_counter() - started
            return total
        truncated = 0
        for _ in range(self.max_attempts):
            total.calls += 1
            try:
                reply = self.client.chat(self.role, messages, max_tokens=self.max_tokens, temperature=self.temperature,
                                         response_format=slate_response_format(len(slate.texts),
                                                                               self.max_reasoning_chars))
            except ClientError as exc:
                raise_if_refused(exc, f"LATTICE's slate scorer (role {self.role!r})")
                total.raw, total.failure = f"<request failed: {exc}>", str(exc)
                continue
            total.failure = ""
            total.input_tokens += reply.usage.get("prompt_tokens", 0)
            total.output_tokens += reply.usage.get("completion_tokens", 0)
            parsed = parse_slate_reply(reply.text, len(slate.texts))
            if reply.finish_reason == "length":
                truncated += 1
                if not parsed.parsed:
                    parsed = parse_truncated_reply(reply.text, len(slate.texts))
            total.raw, total.problems = reply.text, {**parsed.problems, "reply_truncated": truncated}
            if parsed.parsed and parsed.scores:
                total.scores, total.reasoning, total.parsed = parsed.scores, parsed.reasoning, True
                break
        total.seconds = time.perf_counter() - started
        return total

    def _too_long(self, messages: list[dict[str, str]]) -> str:
        """Why the slate's chat ``messages`` plus ``max_tokens`` do not fit the role's context ("" when they fit, or
        when the server lists no context). A failed request to ``/tokenize`` raises its ``ClientError``."""
        context = self._context_length()
        if context is None:
            return ""
        response, _ = self.client.backend.post("/tokenize", {"model": self.role, "messages": messages})
        prompt_tokens = int(response["count"])
        if prompt_tokens + self.max_tokens <= context:
            return ""
        return (f"<not sent: the slate prompt's {prompt_tokens} tokens plus max_tokens={self.max_tokens} exceed the "
                f"{context}-token context of role {self.role!r}; lower max_candidate_chars "
                f"(now {self.max_candidate_chars}) or max_tokens>")

    def _context_length(self) -> int | None:
        """The role's ``max_model_len`` from ``/v1/models``, read once: its own entry's, else (a LoRA module, which vLLM
        lists without one) its ``parent`` base model's; None when the server lists neither."""
        with self._context_lock:
            if not self._context_read:
                cards = {entry.get("id"): entry for response in self.client.backend.get("/v1/models")
                         for entry in response.get("data", [])}
                card = cards.get(self.role, {})
                length = card.get("max_model_len") or cards.get(card.get("parent"), {}).get("max_model_len")
                self._context, self._context_read = (int(length) if length else None), True
            return self._context


def _json_array_after(text: str, key: str) -> str:
    """The JSON array that follows ``"key":`` in ``text``, up to its closing bracket or the end of a cut-off text
    ("" when the key is absent)."""
    start = text.find(f'"{key}"')
    start = text.find("[", start) if start >= 0 else -1
    if start < 0:
        return ""
    depth = 0
    for i in range(start, len(text)):
        depth += {"[": 1, "]": -1}.get(text[i], 0)
        if depth == 0:
            return text[start: i + 1]
    return text[start:]


_PAIR = re.compile(r'\[\s*"?(\d+)"?\s*,\s*"?(-?\d+(?:\.\d+)?)"?\s*\]')
_REASONING = re.compile(r'"reasoning"\s*:\s*"((?:[^"\\]|\\.)*)"')


def parse_truncated_reply(text: str, n_candidates: int) -> SlateParse:
    """A slate reply cut off by ``max_tokens``: its complete ``[id, score]`` pairs (and its reasoning, when that
    string was finished), checked as ``parse_slate_reply`` checks a whole reply; unparsed when the cut came before
    ``relevance_scores``.

    >>> cut = '{"reasoning": "b fits", "ranking": [1, 0, 2], "relevance_scores": [[1, 90], [0, 20], [2, 3'
    >>> p = parse_truncated_reply(cut, 3)
    >>> p.parsed, p.scores, p.missing, p.reasoning
    (True, {1: 90.0, 0: 20.0}, 1, 'b fits')
    >>> parse_truncated_reply('{"reasoning": "it is', 3).parsed
    False
    """
    array = _json_array_after(text, "relevance_scores")
    if not array:
        return parse_slate_reply("", n_candidates)
    found = _REASONING.search(text)
    try:
        reasoning = json.loads(f'"{found.group(1)}"') if found else ""
    except json.JSONDecodeError:  # an escape JSON does not know: the reasoning is lost, the scores are not
        reasoning = ""
    rebuilt = {"reasoning": reasoning,
               "relevance_scores": [[int(i), float(score)] for i, score in _PAIR.findall(array)]}
    return parse_slate_reply(json.dumps(rebuilt), n_candidates)


ACTIVATIONS = ("sigmoid", "identity")  # what a served cross-encoder's scores can be (serving/cross_encoder.py)


class CrossEncoderSlateScorer:
    """Pointwise scoring by a served cross-encoder (``/score``): one batched request per slate, each score mapped to
    0-100 by the activation the server reports with it (``Scores.activation``; ``serving/cross_encoder.py``):
    ``sigmoid``, relevance probabilities in [0, 1], scaled by 100 (the distilled pointwise student is trained on
    teacher score / 100); ``identity``, raw logits, put through a sigmoid first. The sigmoid keeps every logit's
    order and puts them on the 0-1 scale of the search's path relevance (the root's is 1): for a binary
    cross-entropy model it is the probability it was trained for; for a listwise one (ListNet, LambdaLoss: only
    differences between logits are learned) it is order-preserving, its level arbitrary.

    ``activation`` is needed only for a server that does not report one (vLLM's ``/score`` applies the folder's
    saved activation without naming it; this project's stacks serve cross-encoders on the embedded server, which
    always reports). Empty, it means "as the server reports", and a response without a report is a ConfigError
    asking for it. Given, it is checked against each report: a mismatch (a scorer told ``identity`` by a server
    serving probabilities, or the other way round) is a ConfigError naming both, never a silent misreading. Under
    ``sigmoid`` from a server that does not report, scores outside [0, 1] are logits: a ConfigError naming the fix.
    A transient request failure leaves a failed slate (``failure``); a refused request raises ``RequestRefused``."""

    listwise = False

    def __init__(self, client: Client, role: str = "scorer", concurrency: int = 4,
                 activation: Literal["", "sigmoid", "identity"] = ""):
        if activation not in ("", *ACTIVATIONS):
            raise ConfigError(f"activation must be 'sigmoid', 'identity' or empty (as the server reports), got "
                              f"{activation!r}")
        self.client, self.role, self.concurrency, self.activation = client, role, concurrency, activation

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]:
        if not slates:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(slates)))) as pool:
            return list(pool.map(self._score_one, slates))

    def _score_one(self, slate: Slate) -> SlateScore:
        started = time.perf_counter()
        try:
            values = self.client.score(self.role, slate.query, slate.texts)
        except ClientError as exc:
            raise_if_refused(exc, f"LATTICE's cross-encoder scorer (role {self.role!r})")
            return SlateScore(scores={}, raw=f"<request failed: {exc}>", parsed=False,
                              seconds=time.perf_counter() - started, failure=str(exc))
        scores = self.to_scores(values, self.served_activation(values.activation))
        return SlateScore(scores=dict(enumerate(scores)), seconds=time.perf_counter() - started)

    def served_activation(self, reported: str | None) -> str:
        """The activation of a response's scores: the server's ``reported`` one (checked against ``activation``
        when that is set), else ``activation``; a ConfigError when they differ or neither says.

        >>> CrossEncoderSlateScorer(client=None).served_activation("identity")
        'identity'
        >>> CrossEncoderSlateScorer(client=None, activation="sigmoid").served_activation(None)
        'sigmoid'
        >>> CrossEncoderSlateScorer(client=None, activation="sigmoid").served_activation("identity")
        Traceback (most recent call last):
        ...
        overstory.core.config.ConfigError: role 'scorer' serves identity scores (raw logits), but the scorer was \
told activation='sigmoid'; drop the setting (the server's report is used) or set activation='identity'
        """
        if reported is not None and reported not in ACTIVATIONS:
            raise ConfigError(f"role {self.role!r} reports scores of activation {reported!r}, which LATTICE's "
                              f"scorer cannot read (it reads {', '.join(ACTIVATIONS)})")
        if reported and self.activation and reported != self.activation:
            raise ConfigError(f"role {self.role!r} serves {reported} scores ({_MEANING[reported]}), but the scorer "
                              f"was told activation={self.activation!r}; drop the setting (the server's report is "
                              f"used) or set activation={reported!r}")
        if not (reported or self.activation):
            raise ConfigError(f"role {self.role!r}'s server does not say whether its scores are probabilities or "
                              "raw logits (vLLM's /score does not); set the cross-encoder activation ('sigmoid' "
                              "or 'identity', the folder's saved activation)")
        return reported or self.activation

    def to_scores(self, values: Sequence[float], activation: str) -> list[float]:
        """Served scores of ``activation`` as 0-100, in order (see the class docstring).

        >>> scorer = CrossEncoderSlateScorer(client=None)
        >>> [round(s, 1) for s in scorer.to_scores([-2.0, 0.0, 7.5], "identity")]
        [11.9, 50.0, 99.9]
        """
        if activation == "identity":
            return [100.0 * float(expit(v)) for v in values]
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ConfigError(f"role {self.role!r} served scores outside [0, 1] ({list(values)[:5]}) as "
                              "probabilities: its cross-encoder returns raw logits; set the activation to "
                              "'identity'")
        return [100.0 * float(v) for v in values]


_MEANING = {"sigmoid": "probabilities", "identity": "raw logits"}


class OracleSlateScorer:
    """Scores from gold labels: 100 for a gold leaf or a node with a gold leaf below it, else 0. It checks
    that the tree and the search can reach the gold at all (no model involved)."""

    listwise = False

    def __init__(self, tree: Tree, gold_leaves: Mapping[str, set[str]]):
        self._on_path = {query_id: tree.on_paths_to(leaves) for query_id, leaves in gold_leaves.items()}

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]:
        out = []
        for slate in slates:
            on_path = self._on_path.get(slate.query_id, set())
            out.append(SlateScore(scores={i: 100.0 if n in on_path else 0.0
                                          for i, n in enumerate(slate.node_ids)}, seconds=0.0, calls=0))
        return out
