"""Every planner reward on malformed rollouts: a number (or None for "no signal"), never NaN, never an exception."""

from __future__ import annotations

import math

import pytest

from overstory.serving.client import ClientError
from overstory.training.rewards import (
    QAReward,
    QARewardError,
    align_reward,
    format_reward,
    make_cost_reward,
    make_length_reward,
)

TOKENS = {"sentence": 30.0, "paragraph": 120.0, "subsection": 250.0, "section": 900.0, "document": 5000.0}
# shapes seen from untrained and partly trained SmolLM2-135M rollouts, plus the edge cases of the issue
MALFORMED = [
    "", "   ", "{", "}{", "null", "[]", '{"largest_chunk_size": null, "smallest_chunk_size": 3}',
    '{"largest_chunk_size": "chapter", "smallest_chunk_size": "word"}',  # unknown level names
    '{"largest_chunk_size": "sentence", "smallest_chunk_size": "document"}',  # reversed range
    "The answer is in the document. " * 200,  # long, no JSON
    [{"role": "assistant", "content": None}],  # conversational, empty message
    [{"role": "assistant", "content": '{"largest_chunk_size": "Sections", "smallest_chunk_size": "para"}'}],
]


def _finite_or_none(values: list) -> bool:
    return all(v is None or (isinstance(v, float) and math.isfinite(v)) for v in values)


def test_rewards_on_malformed_rollouts_are_finite() -> None:
    n = len(MALFORMED)
    columns = {"level_min": ["sentence"] * n, "level_max": ["section"] * n, "level_tokens": [TOKENS] * n,
               "example_id": [f"q{i}" for i in range(n)], "completion_ids": [[1] * (i * 40) for i in range(n)]}
    qa = QAReward(lambda example_id, low, high: low == "sentence")
    for reward in (format_reward, align_reward, make_cost_reward(5), make_length_reward(128), qa):
        values = reward(MALFORMED, **columns)
        assert len(values) == n and _finite_or_none(values), reward
    formats = format_reward(MALFORMED)
    assert formats[8] == formats[11] == 1.0  # the reversed range is swapped, plural/abbreviated names normalised
    assert sum(formats) == 2.0


def test_degenerate_documents_and_failing_judges_give_no_nan() -> None:
    plan = '{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"}'
    empty = dict.fromkeys(TOKENS, 0.0)
    nan_tokens = {**TOKENS, "document": float("nan")}
    assert _finite_or_none(make_cost_reward(5)([plan, plan], level_tokens=[empty, nan_tokens]))

    def judge(example_id: str, low: str, high: str) -> bool:
        raise TimeoutError("generator timed out")

    assert QAReward(judge, max_none_share=1.0)([plan], example_id=["q"]) == [None]  # no signal, not a wrong answer


def test_length_reward_needs_token_ids() -> None:
    with pytest.raises(ValueError, match="completion_ids"):
        make_length_reward(128)(["x"])
    with pytest.raises(ValueError, match="positive"):
        make_length_reward(0)


PLAN = '{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"}'


def _failing_judge(error: Exception):
    def judge(example_id: str, low: str, high: str) -> bool:
        raise error

    return judge


@pytest.mark.parametrize("status", [400, 404, 422])
def test_qa_reward_raises_on_client_errors_that_retrying_cannot_fix(status: int) -> None:
    qa = QAReward(_failing_judge(ClientError(status, "no server configured for role 'generator'")))
    with pytest.raises(QARewardError, match=f"HTTP {status}.*not dropped silently"):
        qa([PLAN], example_id=["q"])


@pytest.mark.parametrize("error", [ClientError(0, "ConnectError calling http://127.0.0.1:9", 3),
                                   ClientError(503, "overloaded", 3), ClientError(500, "boom", 3),
                                   TimeoutError("generator timed out"), ConnectionError("reset")])
def test_qa_reward_gives_none_on_transient_failures_and_counts_them(error: Exception) -> None:
    logged: list[tuple[str, float]] = []
    qa = QAReward(_failing_judge(error), max_none_share=0.75)
    assert qa([PLAN, "no plan", PLAN, PLAN], example_id=["q1", "q1", "q2", "q3"],
              log_metric=lambda name, value: logged.append((name, value))) == [None, 0.0, None, None]
    assert (qa.calls, qa.nones, qa.none_share) == (4, 3, 0.75)
    assert logged == [("qa_none_share", 0.75)]
    assert qa.cache == {}  # a transient failure is not cached: the next rollout asks again


def test_qa_reward_other_errors_propagate_and_share_accumulates() -> None:
    with pytest.raises(KeyError):  # a bug in the judge is not "no signal"
        QAReward(_failing_judge(KeyError("q")))([PLAN], example_id=["q"])
    answers = iter([ClientError(503, "busy"), True, True])

    def flaky(example_id: str, low: str, high: str) -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    qa = QAReward(flaky, max_none_share=1.0)
    assert qa.none_share is None
    assert qa([PLAN], example_id=["q"]) == [None]
    assert qa([PLAN, PLAN], example_id=["q", "q"]) == [1.0, 1.0]  # retried, then cached
    assert qa.none_share == pytest.approx(1 / 3)


def test_qa_reward_stops_the_run_when_most_of_a_call_has_no_answer() -> None:
    """A stack that stopped answering (its vLLM server killed for memory) makes every answer a transient failure:
    the call whose None share is above the limit raises, naming the count and the last failure, instead of letting
    the steps after train without R_QA."""
    answers = {"q1": True, "q2": ClientError(0, "ConnectError calling http://127.0.0.1:8001", 3)}

    def judge(example_id: str, low: str, high: str) -> bool:
        answer = answers[example_id]
        if isinstance(answer, Exception):
            raise answer
        return answer

    qa = QAReward(judge, max_none_share=0.5)
    assert qa([PLAN, PLAN], example_id=["q1", "q2"]) == [1.0, None]  # half: at the limit, not above it
    with pytest.raises(QARewardError, match=r"no answer for 2 of 3 completions.*0\.5.*ConnectError"):
        qa([PLAN, PLAN, PLAN], example_id=["q1", "q2", "q2"])


def test_format_reward_logs_the_strict_rate_without_changing_its_values() -> None:
    replies = [PLAN, "{'largest_chunk_size': 'section', 'smallest_chunk_size': 'sentence'}",
               '{"largest_chunk_size": "sentence", "smallest_chunk_size": "section"}', "no plan"]
    logged: list[tuple[str, float]] = []
    values = format_reward(replies, log_metric=lambda name, value: logged.append((name, value)))
    assert values == format_reward(replies) == [1.0, 1.0, 1.0, 0.0]
    assert logged == [("format_valid_strict", 0.25)]
