"""The planner's parser on real malformed replies (SmolLM2-135M, untrained) and on the shapes models get wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.models.planner import normalise_level, parse_plan, plan_json, planner_messages, strict_plan_valid

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


# replies in the shapes partly trained SmolLM2-135M planners write: the tolerant parser reads a plan from every one
# of them (the runtime acts on it), the strict check accepts only the first two
STRICT_CASES = [
    ('The question asks for a date. The evidence is one fact.\n'
     '{"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"}', True),
    ('```json\n{"largest_chunk_size": "section", "smallest_chunk_size": "section"}\n```', True),
    ('So the smallest is sentence.\n{"largest_chunk_size": "paragraph", "smallest_chunk_size": "sentence"',
     False),  # cut off at the completion limit: no closing brace
    ("{'largest_chunk_size': 'paragraph', 'smallest_chunk_size': 'sentence'}", False),  # single quotes
    ('{"largest_chunk_size": "paragraphs", "smallest_chunk_size": "sentences"}', False),  # plural level names
    ('{"largest_chunk_size": "Paragraph", "smallest_chunk_size": "sentence"}', False),  # capitalised
    ('{"largest_chunk_size": "sentence", "smallest_chunk_size": "section"}', False),  # reversed range
    ('{"largest_chunk_size": "section", "smallest_chunk_size": "sentence",}', False),  # trailing comma
    ('{largest_chunk_size: "section", smallest_chunk_size: "sentence"}', False),  # unquoted keys
    ('{"largest_chunk_size": "section", "smallest_chunk_size": "sentence", "reason": "fact"}', False),  # extra key
    ("largest_chunk_size: section\nsmallest_chunk_size: sentence", False),  # no braces at all
]


@pytest.mark.parametrize(("reply", "strict"), STRICT_CASES)
def test_strict_check_against_the_tolerant_parser(reply: str, strict: bool) -> None:
    assert parse_plan(reply).valid
    assert strict_plan_valid(reply) is strict


@pytest.mark.parametrize("reply", REPLIES)
def test_real_untrained_replies_fail_the_strict_check(reply: str) -> None:
    assert not strict_plan_valid(reply)


def test_strict_check_takes_the_last_object() -> None:
    earlier_ok = plan_json("sentence", "section") + " no wait {'largest_chunk_size': 'section'}"
    assert not strict_plan_valid(earlier_ok)
    assert strict_plan_valid("{'draft': 1} then " + plan_json("sentence", "section"))
