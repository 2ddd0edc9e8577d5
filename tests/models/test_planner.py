"""The planner's parser on real malformed replies (SmolLM2-135M, untrained) and on the shapes models get wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.models.planner import normalise_level, parse_plan, plan_json, planner_messages

REPLIES = json.loads((Path(__file__).parent / "data" / "smollm2_base_planner_replies.json").read_text())


@pytest.mark.parametrize("reply", REPLIES)
def test_real_untrained_replies_are_format_failures_not_errors(reply: str) -> None:
    plan = parse_plan(reply)  # recorded with the planner prompt; none holds a plan
    assert not plan.valid and plan.raw == reply and "no JSON object" in plan.error


@pytest.mark.parametrize(("reply", "levels", "swapped"), [
    ('Reasoning... {"largest_chunk_size": "section", "smallest_chunk_size": "paragraph"}', ("paragraph", "section"),
     False),
    ("```json\n{\"largest_chunk_size\": \"Paragraphs\", \"smallest_chunk_size\": \"SENTENCE\"}\n```",
     ("sentence", "paragraph"), False),
    ("{largest_chunk_size: 'whole document', smallest_chunk_size: 'sub-section',}", ("subsection", "document"), False),
    ('{"largest_chunk_size": "sentence", "smallest_chunk_size": "section"}', ("sentence", "section"), True),
    ('first {"largest_chunk_size": "document", "smallest_chunk_size": "sentence"} then '
     '{"largest_chunk_size": "paragraph", "smallest_chunk_size": "paragraph"}', ("paragraph", "paragraph"), False),
    ("largest_chunk_size: section\nsmallest_chunk_size: sentence", ("sentence", "section"), False),
    ('{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"', ("sentence", "section"), False),  # cut off
])
def test_tolerated_shapes(reply: str, levels: tuple[str, str], swapped: bool) -> None:
    plan = parse_plan(reply)
    assert plan.levels == levels and plan.swapped == swapped


@pytest.mark.parametrize(("reply", "error"), [
    ('{"largest_chunk_size": "chapter", "smallest_chunk_size": "sentence"}', "unknown level 'chapter'"),
    ('{"largest_chunk_size": "section"}', "missing smallest_chunk_size"),
    ('{"largest_chunk_size": "section", "smallest_chunk_size": 3}', "unknown level 3"),
    ("", "no JSON object"),
])
def test_invalid_replies_say_why(reply: str, error: str) -> None:
    plan = parse_plan(reply)
    assert not plan.valid and error in plan.error and plan.levels is None


def test_plan_json_round_trips_and_prompt_carries_the_question() -> None:
    assert parse_plan(plan_json("subsection", "document")).levels == ("subsection", "document")
    messages = planner_messages("  Who ruled Normandy? ", "Title: Normans\nThe Normans were...")
    assert messages[0]["role"] == "system" and "largest_chunk_size" in messages[0]["content"]
    assert messages[1]["content"].endswith("Question: Who ruled Normandy?")
    assert normalise_level("Sections") == "section" and normalise_level("") is None
