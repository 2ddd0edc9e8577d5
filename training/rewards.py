"""Planner rewards, in TRL's reward-function signature: ``f(completions, **columns) -> list[float | None]``.

GRPOTrainer calls every reward with ``prompts``, ``completions`` (strings, or lists of chat messages
for conversational data), ``completion_ids`` and the dataset's other columns, one value per
completion; ``GRPOConfig.reward_weights`` holds the weights (gamma, beta, alpha, ...), so each function
here returns the unweighted term. STITCH, the verl reward entry and ``eval planner`` call the same
functions. A reward that cannot be computed returns None (TRL ignores it for that completion, as
it does NaN); no function here returns NaN or raises on a malformed completion (an empty document
cannot divide by zero in ``read_share``).

- ``format_reward``: 1 when the reply ends in a JSON plan with valid levels (R_format / gamma). Under TRL it
  also logs ``format_valid_strict`` (the share of completions that pass ``strict_plan_valid``) through the
  trainer's ``log_metric``: a logged number only, the reward itself is the tolerant one.
- ``length_reward``: -ReLU(completion tokens - L_max) (R_length / beta).
- ``align_reward``: overlap of the predicted level range with the pseudo-label, 1 for an exact match,
  partial credit for overlapping ranges (the cheap stand-in for R_QA + R_cost).
- ``cost_reward``: minus the share of the document the reader would see for the predicted range (R_cost / alpha).
- ``QAReward``: 1 when SmartChunk retrieval over the predicted range plus the generator answers correctly
  (R_QA), cached by (example, range) so repeated rollouts of one question cost one retrieval each. Only
  transient failures (timeouts, transport errors, 5xx after the client's retries) give None; a 4xx (a wrong
  role or model name, a malformed request) raises ``QARewardError``, and so does a call whose share of None is
  above ``max_none_share`` (the stack is down: training on would be a run without R_QA). Each call logs
  ``qa_none_share``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from overstory.core.records import LEVELS
from overstory.models.planner import Plan, parse_plan, strict_plan_valid
from overstory.retrieval.strategy import transient as transient_client_error
from overstory.serving.client import ClientError


def completion_text(completion: str | Sequence[Mapping[str, str]]) -> str:
    """The text of a completion, standard (a string) or conversational (a list of messages).

    >>> completion_text([{"role": "assistant", "content": "hi"}]), completion_text("hi")
    ('hi', 'hi')
    """
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content") or "" for message in completion)


def _plans(completions: Sequence) -> list[Plan]:
    return [parse_plan(completion_text(c)) for c in completions]


def strict_format_rate(completions: Sequence) -> float:
    """The share of completions whose plan passes ``strict_plan_valid`` (0.0 for none).

    >>> strict_format_rate(['{"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}',
    ...                     "{'largest_chunk_size': 'section', 'smallest_chunk_size': 'paragraph'}"])
    0.5
    """
    return sum(strict_plan_valid(completion_text(c)) for c in completions) / max(len(completions), 1)


def format_reward(completions: Sequence, log_metric: Callable[[str, float], None] | None = None,
                  **kwargs: Any) -> list[float]:
    """1.0 when the reply parses to a valid level range, else 0.0. ``log_metric`` (TRL passes its trainer's) gets
    the strict format rate of the batch as ``format_valid_strict``; the values returned do not depend on it.

    >>> logged = []
    >>> format_reward(['ok {"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}', "no plan",
    ...                '{"largest_chunk_size": "sections", "smallest_chunk_size": "paragraph"}'],
    ...               log_metric=lambda name, value: logged.append((name, value)))
    [1.0, 0.0, 1.0]
    >>> logged
    [('format_valid_strict', 0.3333333333333333)]
    """
    if log_metric is not None:
        log_metric("format_valid_strict", strict_format_rate(completions))
    return [1.0 if plan.valid else 0.0 for plan in _plans(completions)]


def make_length_reward(max_tokens: int) -> Callable[..., list[float]]:
    """-ReLU(tokens - max_tokens) per completion, from the ``completion_ids`` TRL passes.

    >>> length_reward = make_length_reward(4)
    >>> length_reward(["a", "b"], completion_ids=[[1, 2, 3], [1, 2, 3, 4, 5, 6]])
    [0.0, -2.0]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")

    def length_reward(completions: Sequence, completion_ids: Sequence[Sequence[int]] | None = None,
                      **kwargs: Any) -> list[float]:
        if completion_ids is None:
            raise ValueError("length_reward needs completion_ids (the completions' token ids)")
        return [float(min(0, max_tokens - len(ids))) for ids in completion_ids]

    return length_reward


def range_overlap(predicted: tuple[str, str], label: tuple[str, str]) -> float:
    """Intersection over union of two level ranges (level_min, level_max), counted in levels.

    >>> range_overlap(("paragraph", "section"), ("paragraph", "section"))
    1.0
    >>> range_overlap(("sentence", "paragraph"), ("paragraph", "subsection"))
    0.3333333333333333
    >>> range_overlap(("sentence", "sentence"), ("section", "document"))
    0.0
    """
    (p_low, p_high), (l_low, l_high) = ((LEVELS.index(a), LEVELS.index(b)) for a, b in (predicted, label))
    intersection = max(0, min(p_high, l_high) - max(p_low, l_low) + 1)
    union = max(p_high, l_high) - min(p_low, l_low) + 1
    return intersection / union


def align_reward(completions: Sequence, level_min: Sequence[str], level_max: Sequence[str],
                 **kwargs: Any) -> list[float]:
    """Agreement with the pseudo-label: ``range_overlap`` of predicted and labelled ranges; 0 for no plan.

    >>> align_reward(['{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"}', "none"],
    ...              level_min=["sentence", "sentence"], level_max=["paragraph", "paragraph"])
    [0.5, 0.0]
    """
    return [range_overlap(plan.levels, (low, high)) if plan.valid else 0.0
            for plan, low, high in zip(_plans(completions), level_min, level_max, strict=True)]


def read_share(levels: tuple[str, str], level_tokens: Mapping[str, float], k: int) -> float:
    """Share of the document a reader sees when top-``k`` chunks come from the range ``levels``.

    ``level_tokens`` gives the mean chunk length (tokens) of each level in this document; the
    expected chunk read is the mean over the levels in range. Building the range's upper levels
    costs compressor calls only (three orders of magnitude cheaper than reading; see
    ``eval compressor``), so reading dominates the cost.

    >>> tokens = {"sentence": 30, "paragraph": 120, "subsection": 250, "section": 900, "document": 5000}
    >>> read_share(("sentence", "sentence"), tokens, 5), read_share(("paragraph", "section"), tokens, 5)
    (0.03, 0.4233333333333333)
    >>> read_share(("section", "document"), tokens, 5)
    1.0
    """
    low, high = LEVELS.index(levels[0]), LEVELS.index(levels[1])
    per_chunk = sum(level_tokens[level] for level in LEVELS[low: high + 1]) / (high - low + 1)
    return min(1.0, k * per_chunk / max(level_tokens["document"], 1.0))


def make_cost_reward(k: int) -> Callable[..., list[float]]:
    """-``read_share`` of the predicted range (-1, the whole document, when there is no valid plan).

    >>> cost_reward = make_cost_reward(2)
    >>> tokens = {"sentence": 10, "paragraph": 50, "subsection": 100, "section": 400, "document": 1000}
    >>> cost_reward(['{"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}', "?"],
    ...             level_tokens=[tokens, tokens])
    [-0.06, -1.0]
    """

    def cost_reward(completions: Sequence, level_tokens: Sequence[Mapping[str, float]], **kwargs: Any) -> list[float]:
        return [-read_share(plan.levels, tokens, k) if plan.valid else -1.0
                for plan, tokens in zip(_plans(completions), level_tokens, strict=True)]

    return cost_reward


class QARewardError(RuntimeError):
    """R_QA's backend refused a request for a reason retrying will not fix (a 4xx: wrong role, model or request)."""


def transient(exc: BaseException) -> bool:
    """Whether a failure of R_QA's backend is worth no more than a missing reward: timeouts, dropped connections,
    and the client errors every strategy treats as transient (``retrieval.strategy.transient``: transport errors,
    408, 429, and server errors left after the client's retries).

    >>> [transient(e) for e in (TimeoutError(), ConnectionError(), ClientError(0, "refused"), ClientError(503, "busy"),
    ...                         ClientError(429, "slow down"), ClientError(404, "no role"), ClientError(400, "bad"),
    ...                         RuntimeError("bug"))]
    [True, True, True, True, True, False, False, False]
    """
    if isinstance(exc, ClientError):
        return transient_client_error(exc)
    return isinstance(exc, (TimeoutError, ConnectionError))


class QAReward:
    """R_QA: 1.0 when answering from the predicted range is correct, 0.0 when wrong or when there is no
    plan, None when the answer could not be obtained for a transient reason (``transient``: the generator
    timed out, the server is down or overloaded: no signal). Any other failure raises: a 4xx as
    ``QARewardError`` (a None there would silently drop R_QA from every rollout), anything else as it is. A call
    whose rewards are None for more than ``max_none_share`` of its completions raises ``QARewardError`` too, with the
    last failure: a stack that stopped answering (a vLLM server killed for memory) would otherwise turn every later
    step into a run without R_QA while the job carries on; stopped, it resumes from its last checkpoint.

    ``answer_correct(example_id, level_min, level_max) -> bool`` runs SmartChunk retrieval and the
    generator (``training/qa_judge.py: QAJudge``); results are cached per (example, range), and
    the distinct ones a call needs are asked ``concurrency`` at a time.
    ``calls`` and ``nones`` count the rewards returned and the Nones among them (``none_share``); each call also
    logs its batch's None share as ``qa_none_share`` through ``log_metric`` when TRL passes one.

    >>> calls = []
    >>> def judge(example_id, low, high):
    ...     calls.append((example_id, low, high))
    ...     return low == "sentence"
    >>> qa = QAReward(judge)
    >>> plan = '{"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}'
    >>> qa([plan, plan, "no plan"], example_id=["q1", "q1", "q1"])
    [1.0, 1.0, 0.0]
    >>> calls
    [('q1', 'sentence', 'paragraph')]
    >>> QAReward(judge, concurrency=4)([plan, '{"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}'],
    ...                                example_id=["q1", "q2"])
    [1.0, 0.0]
    """

    __name__ = "qa_reward"  # TRL names each reward's logged column after __name__

    def __init__(self, answer_correct: Callable[[str, str, str], bool], concurrency: int = 1,
                 max_none_share: float = 0.5):
        self.answer_correct, self.concurrency, self.max_none_share = answer_correct, concurrency, max_none_share
        self.cache: dict[tuple[str, str, str], bool | None] = {}
        self.calls = 0  # rewards returned
        self.nones = 0  # of which None (no signal)
        self.last_failure = ""  # the latest transient failure, for the error that stops a run
        self._lock = threading.Lock()

    @property
    def none_share(self) -> float | None:
        """The share of all rewards returned so far that were None (None before the first call)."""
        return self.nones / self.calls if self.calls else None

    def _correct(self, key: tuple[str, str, str]) -> bool | None:
        with self._lock:
            if key in self.cache:
                return self.cache[key]
        try:
            result: bool | None = bool(self.answer_correct(*key))
        except Exception as exc:
            if transient(exc):
                with self._lock:
                    self.last_failure = f"{type(exc).__name__}: {exc}"
                return None  # not cached: a later rollout may get through
            if isinstance(exc, ClientError):
                raise QARewardError(f"R_QA: the retrieval/generator stack refused the request for {key[0]!r} with "
                                    f"{exc} (HTTP {exc.status}); a 4xx does not go away by retrying, so the reward "
                                    f"is not dropped silently: check the stack's roles and model names "
                                    f"(server_url / serve)") from exc
            raise
        with self._lock:
            self.cache[key] = result
        return result

    def __call__(self, completions: Sequence, example_id: Sequence[str],
                 log_metric: Callable[[str, float], None] | None = None, **kwargs: Any) -> list[float | None]:
        keys = [(example, plan.level_min, plan.level_max) if plan.valid else None
                for plan, example in zip(_plans(completions), example_id, strict=True)]
        # each distinct (question, range) answered once per call, `concurrency` of them at a time
        distinct = list(dict.fromkeys(key for key in keys if key is not None))
        with ThreadPoolExecutor(max(1, min(self.concurrency, len(distinct)))) as pool:
            found = dict(zip(distinct, pool.map(self._correct, distinct)))
        rewards = [0.0 if key is None else None if found[key] is None else float(found[key]) for key in keys]
        nones = sum(r is None for r in rewards)
        with self._lock:
            self.calls += len(rewards)
            self.nones += nones
        if log_metric is not None and rewards:
            log_metric("qa_none_share", nones / len(rewards))
        if rewards and nones / len(rewards) > self.max_none_share:
            raise QARewardError(f"R_QA: no answer for {nones} of {len(rewards)} completions of this call, above "
                                f"rewards.qa_max_none_share ({self.max_none_share}); the last failure: "
                                f"{self.last_failure}. The retrieval/generator stack is down or overloaded: check its "
                                f"log, then rerun to resume from the last checkpoint")
        return rewards
