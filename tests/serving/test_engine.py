"""EmbeddedEngine on the real SmolLM2: shared models, per-role context limits, batches, greedy n."""

from __future__ import annotations

import time

import pytest

from overstory.core.config import ConfigError
from overstory.models.registry import SMOLLM2
from overstory.serving.batching import Batcher, Job, Sampling
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.errors import BadRequest, RequestTooLarge

PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at"]


def test_roles_share_one_model_but_not_its_context_limit(engines) -> None:
    engine = engines(ServeConfig(port=0, roles={"generator": RoleConfig(model=SMOLLM2),
                                                "planner": RoleConfig(model=SMOLLM2, max_model_len=24)}))
    assert engine.tokenizer("generator") is engine.tokenizer("planner")  # one copy in memory
    prompt = " ".join(["word"] * 10)
    assert engine.complete("generator", prompt, max_tokens=16, temperature=0).prompt_tokens == 10
    with pytest.raises(RequestTooLarge, match="10 prompt tokens \\+ 16 completion tokens = 26, more than the "
                                              "model's context of 24"):
        engine.complete("planner", prompt, max_tokens=16, temperature=0)
    with pytest.raises(ConfigError, match="roles.planner.max_model_len: 9000 exceeds the model's context of 8192"):
        EmbeddedEngine(ServeConfig(port=0, roles={"planner": RoleConfig(model=SMOLLM2, max_model_len=9000)}))


def test_a_batch_of_prompts_matches_one_by_one(engine: EmbeddedEngine) -> None:
    batch = engine.complete("generator", PROMPTS, max_tokens=6, temperature=0)
    single = [engine.complete("generator", p, max_tokens=6, temperature=0) for p in PROMPTS]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in single]
    assert [c.completion_tokens for c in batch.choices] == [s.choices[0].completion_tokens for s in single]
    assert batch.prompt_tokens == sum(s.prompt_tokens for s in single)


def test_greedy_n_repeats_the_choice_and_sampling_n_per_prompt(engine: EmbeddedEngine) -> None:
    greedy = engine.complete("generator", PROMPTS[0], max_tokens=4, temperature=0, n=2)
    assert len(greedy.choices) == 2 and greedy.choices[0] == greedy.choices[1]
    sampled = engine.complete("generator", PROMPTS[:2], max_tokens=4, temperature=1.0, n=2, seed=0)
    assert len(sampled.choices) == 4  # n per prompt, prompt by prompt


def test_bad_generation_requests(engine: EmbeddedEngine) -> None:
    with pytest.raises(BadRequest, match="prompt must not be empty"):
        engine.complete("generator", "")
    with pytest.raises(BadRequest, match="not a chat model"):
        engine.complete("embedder", "hello")
    with pytest.raises(BadRequest, match="messages\\[0\\].role"):
        engine.chat("generator", [{"role": "wizard", "content": "x"}])
    with pytest.raises(BadRequest, match="answers no earlier assistant tool call"):
        engine.chat("generator", [{"role": "tool", "tool_call_id": "call_1", "content": "x"}])


def test_concurrent_requests_share_batches_and_match_one_by_one(engine: EmbeddedEngine) -> None:
    """Requests sent together run as one batch (per-row max_tokens and stop strings) and greedy outputs equal
    the same requests run alone."""
    requests = [{"prompt": p, "max_tokens": m, "temperature": 0, "stop": s}
                for p, m, s in zip(PROMPTS * 2, [3, 9, 6, 12, 5, 8], [None, [","], None, None, ["."], None])]
    alone = [engine.complete("generator", **r).choices[0] for r in requests]
    batcher = engine.batcher("generator")
    batcher.recent_batches.clear()
    pending = [engine.start_completion("generator", **r) for r in requests]  # queued before the worker wakes
    together = [p.result().choices[0] for p in pending]
    assert together == alone
    assert max(rows for rows, _ in batcher.recent_batches) > 1  # at least two requests shared a generate call
    assert [c.completion_tokens <= r["max_tokens"] for c, r in zip(together, requests)] == [True] * len(requests)


def test_chat_rows_prefill_the_template_opening_once_and_match_one_by_one(engine: EmbeddedEngine) -> None:
    """Chat prompts share the chat template's opening: a batch computes it once for all its rows (the rows'
    own suffixes padded between it and them) and greedy outputs still equal the same requests run alone."""
    questions = ["Who wrote Hamlet?", "What is the boiling point of water in Fahrenheit?", "Name a prime number.",
                 "Why is the sky blue?"]
    requests = [{"messages": [{"role": "user", "content": q}], "max_tokens": 8, "temperature": 0} for q in questions]
    alone = [engine.chat("generator", **r) for r in requests]
    batcher = engine.batcher("generator")
    batcher.recent_batches.clear()
    together = [p.result().choices[0] for p in [engine.start_chat("generator", **r) for r in requests]]
    assert together == [result.choices[0] for result in alone]
    shared = [shared for rows, shared in batcher.recent_batches if rows > 1]
    assert shared and 8 <= max(shared) < min(result.prompt_tokens for result in alone)


def test_a_cancelled_request_stops_and_its_batch_goes_on(engine: EmbeddedEngine) -> None:
    long = engine.start_completion("generator", "Once upon a time", max_tokens=400, temperature=0,
                                   on_delta=lambda index, text: None)
    short = engine.start_completion("generator", "One, two, three,", max_tokens=6, temperature=0)
    long.cancel()
    assert long.result().choices[0].finish_reason == "cancelled" and long.result().choices[0].completion_tokens < 400
    assert short.result().choices[0].finish_reason == "length" and short.result().choices[0].completion_tokens == 6


def test_requests_that_trickle_in_wait_for_each_other_up_to_the_cap(engine: EmbeddedEngine) -> None:
    """The batcher starts a batch once requests stop arriving (a quiet gap), not a fixed window after the first:
    jobs 20 ms apart join one batch under a 200 ms gap, and the cap still starts a batch while they keep coming."""
    served = engine.batcher("generator")
    prompt = served.tokenizer("One, two, three,")["input_ids"]

    def trickle(batcher: Batcher, gap_s: float) -> list[int]:
        jobs = []
        for _ in range(4):
            jobs.append(batcher.submit(Job([prompt], Sampling(max_tokens=2, temperature=0))))
            time.sleep(gap_s)
        for job in jobs:
            job.wait(60)
        return [rows for rows, _ in batcher.recent_batches]

    patient = Batcher(served.model, served.tokenizer, window_s=0.2, max_wait_s=5.0, name="patient")
    capped = Batcher(served.model, served.tokenizer, window_s=0.2, max_wait_s=0.01, name="capped")
    try:
        assert trickle(patient, 0.02) == [4]
        assert len(trickle(capped, 0.3)) > 1
    finally:
        patient.stop()
        capped.stop()
