"""The scorer's slate replies: every valid score of a damaged reply is kept, the rest counted."""

from __future__ import annotations

import xgrammar as xgr

from overstory.models.registry import SMOLLM2, load_tokenizer
from overstory.models.scorer import parse_slate_reply, slate_prompt, slate_response_format
from overstory.serving.structured import GrammarCompilerCache, grammar_spec


def test_clean_reply():
    parsed = parse_slate_reply('{"reasoning": "b answers it", "ranking": [1, 0], '
                               '"relevance_scores": [[0, 20], [1, 95]]}', n_candidates=2)
    assert parsed.parsed and parsed.scores == {0: 20.0, 1: 95.0} and parsed.ranking == [1, 0]
    assert parsed.reasoning == "b answers it" and sum(parsed.problems.values()) == 0


def test_damaged_replies_keep_their_valid_scores():
    # prose around it, single quotes, a trailing comma, string ids, an id as "[2]", a dict pair
    parsed = parse_slate_reply("Here you go: {'reasoning': 'x', 'ranking': [0], 'relevance_scores': "
                               "[['0', 50], ['[2]', 70.5], {'id': 1, 'score': 10},]}", n_candidates=4)
    assert parsed.scores == {0: 50.0, 2: 70.5, 1: 10.0} and parsed.missing == 1
    parsed = parse_slate_reply('{"reasoning": "", "ranking": [], "relevance_scores": [[0, -5], [0, 60], [9, 60], '
                               '[1, "high"], [2]]}', n_candidates=3)
    assert parsed.scores == {0: 0.0}
    assert (parsed.out_of_range, parsed.duplicate, parsed.hallucinated, parsed.malformed_pairs, parsed.missing) == \
        (1, 1, 1, 2, 2)


def test_non_json_reply_is_unparsed_with_every_candidate_missing():
    parsed = parse_slate_reply("I think passage 2 is the best one.", n_candidates=3)
    assert not parsed.parsed and parsed.scores == {} and parsed.missing == 3


def test_prompt_numbers_candidates_and_schema_requires_reasoning_first():
    prompt = slate_prompt("Which band?", ["Topic A: bands", "Passage\nwith  newline"], leaf=True, max_chars=10)
    assert "[0] Topic A: b" in prompt and "[1] Passage wi" in prompt and "Which band?" in prompt
    schema = slate_response_format(2, max_reasoning_chars=50)["json_schema"]["schema"]
    assert list(schema["properties"]) == ["reasoning", "ranking", "relevance_scores"]  # reasoning first
    assert schema["properties"]["reasoning"]["maxLength"] == 50


def test_the_grammar_takes_a_score_for_every_candidate_in_order_and_nothing_less():
    """The served grammar (xgrammar, as both engines build it) admits a reply only when it scores every candidate
    once, in slate order: a 1.5B teacher under a schema that asked for one score at least scored one or two
    candidates of a slate and stopped."""
    grammar = GrammarCompilerCache(load_tokenizer(SMOLLM2), 49152).compile(grammar_spec(slate_response_format(3)))

    def accepts(reply: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(reply) and matcher.is_completed()

    assert accepts('{"reasoning": "b", "ranking": [1, 0], "relevance_scores": [[0, 20], [1, 95], [2, 0]]}')
    assert not accepts('{"reasoning": "b", "ranking": [1], "relevance_scores": [[1, 95]]}')  # stops early
    assert not accepts('{"reasoning": "b", "ranking": [1], "relevance_scores": [[1, 95], [0, 20], [2, 0]]}')
    assert not accepts('{"reasoning": "b", "ranking": [1], "relevance_scores": [[0, 20], [1, 95], [2, 0], [2, 1]]}')
