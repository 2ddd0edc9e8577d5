"""Slate scorers the LATTICE search can call: a served LLM (listwise JSON), a served cross-encoder, an oracle.

Each takes a batch of slates (from every query of a lockstep iteration) and returns one ``SlateScore``
per slate with scores 0-100 by slate position, the reply's reasoning and raw text, and its cost (calls,
tokens from the server's ``usage``, seconds). The LLM scorer sends a batch's slates concurrently, so a
batching server (vLLM, the embedded engine) sees them together.

A request that fails for a transient reason (a timeout, the server down, a 5xx, 408 or 429: ``transient``) leaves a
failed slate, its error in ``SlateScore.failure``, so a rerun of the traces job asks again; a request the server
refuses for good (any other 4xx: a wrong role or model name, a bad request) raises ``RequestRefused``, since every
slate would fail the same way and a search of failed slates still ranks, from no scores at all.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from overstory.models.scorer import parse_slate_reply, slate_prompt, slate_response_format
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

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]:
        if not slates:
            return []
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(slates)))) as pool:
            return list(pool.map(self._score_one, slates))

    def _score_one(self, slate: Slate) -> SlateScore:
        prompt = slate_prompt(slate.query, slate.texts, slate.leaf, max_chars=self.max_candidate_chars)
        total = SlateScore(scores={}, parsed=False, calls=0)
        started = time.perf_counter()
        for _ in range(self.max_attempts):
            total.calls += 1
            try:
                reply = self.client.chat(self.role, [{"role": "user", "content": prompt}],
                                         max_tokens=self.max_tokens, temperature=self.temperature,
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
            total.raw, total.problems = reply.text, parsed.problems
            if parsed.parsed and parsed.scores:
                total.scores, total.reasoning, total.parsed = parsed.scores, parsed.reasoning, True
                break
        total.seconds = time.perf_counter() - started
        return total


class CrossEncoderSlateScorer:
    """Pointwise scoring by a served cross-encoder (``/score``): one batched request per slate, the
    relevance in [0, 1] scaled to 0-100 (the distilled student is trained on teacher score / 100). A transient
    request failure leaves a failed slate (``failure``); a refused request raises ``RequestRefused``."""

    listwise = False

    def __init__(self, client: Client, role: str = "scorer", concurrency: int = 4):
        self.client, self.role, self.concurrency = client, role, concurrency

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
        scores = {i: min(max(float(v), 0.0), 1.0) * 100.0 for i, v in enumerate(values)}
        return SlateScore(scores=scores, seconds=time.perf_counter() - started)


class OracleSlateScorer:
    """Scores from gold labels: 100 for a gold leaf or a node with a gold leaf below it, else 0. It checks
    that the tree and the search can reach the gold at all (no model involved)."""

    listwise = False

    def __init__(self, tree: Tree, gold_leaves: Mapping[str, set[str]]):
        self.gold_leaves = gold_leaves
        self._leaves_under = {node_id: {leaf.id for leaf in tree.leaves(node_id)} for node_id in tree.nodes}

    def score(self, slates: Sequence[Slate]) -> list[SlateScore]:
        out = []
        for slate in slates:
            gold = self.gold_leaves.get(slate.query_id, set())
            out.append(SlateScore(scores={i: 100.0 if self._leaves_under[n] & gold else 0.0
                                          for i, n in enumerate(slate.node_ids)}, seconds=0.0, calls=0))
        return out
