"""The `scorer` role's I/O for LATTICE's listwise traversal: slate prompts, the reply schema, the tolerant parser.

A slate is a query plus numbered candidates: the children of the node being expanded (topic clusters or
passages) and a few calibration nodes from other branches. The scorer reasons first, then scores every
candidate from 0 to 100, in the released LATTICE code's schema::

    {"reasoning": "...", "ranking": [2, 0, 1], "relevance_scores": [[0, 85], [1, 10], [2, 92]]}

Candidates are numbered by slate position (0..n-1), as in the released code: short ids a small model
copies reliably. The parser keeps every valid score of a damaged reply and counts the rest, where the
released code drops the whole slate (and crashes on a score above 100).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from overstory.models.json_reply import as_int, json_objects, loads_tolerant

CLUSTER_PROMPT = """You navigate a tree of topics to find what answers a search query. Each candidate below \
is a topic cluster (a name and a description of the passages under it) or a passage.

Query: {query}

Candidates:
{candidates}

Reason briefly about what the query needs and which candidates lead to it, then rank the candidates and \
give each one a relevance score from 0 (cannot lead to an answer) to 100 (certainly leads to one). \
Reply with one JSON object: {{"reasoning": string, "ranking": [candidate ids, best first], \
"relevance_scores": [[candidate id, score], ...]}} covering every candidate id."""

LEAF_PROMPT = """You judge passages for a search query. A passage is relevant when its own text answers the \
query or gives a critical part of the answer; a title, heading or mention of other content is not.

Query: {query}

Candidates:
{candidates}

Reason briefly about what the query needs and what each passage contributes, then rank the passages and \
give each one a relevance score from 0 (no help) to 100 (answers it). Reply with one JSON object: \
{{"reasoning": string, "ranking": [candidate ids, best first], "relevance_scores": [[candidate id, score], \
...]}} covering every candidate id."""

# The reply schema's version, recorded with every traces job's settings: a record made under another schema is another
# teacher's search (the first schema required one score at least, and the teacher scored one or two candidates of a
# slate and stopped).
SLATE_SCHEMA = "one-score-per-candidate"


def slate_response_format(n_candidates: int, max_reasoning_chars: int = 400) -> dict:
    """The reply schema for a slate of ``n_candidates``, bounded: ids in range, scores 0-100, exactly one score per
    candidate in slate order, and the reasoning capped (a small model otherwise reasons until its token limit and
    never reaches the scores). Grammar-constrained decoding enforces every bound: a model cannot stop after its
    favourite candidate, and the ids of ``relevance_scores`` are fixed, so it only chooses the scores. The parser
    still checks them for servers that do not constrain decoding.

    >>> fmt = slate_response_format(3)["json_schema"]["schema"]["properties"]
    >>> fmt["relevance_scores"]["minItems"], fmt["relevance_scores"]["prefixItems"][2]["prefixItems"][0]
    (3, {'const': 2})
    """
    candidate_id = {"type": "integer", "minimum": 0, "maximum": max(n_candidates - 1, 0)}
    score = {"type": "integer", "minimum": 0, "maximum": 100}
    pairs = [{"type": "array", "prefixItems": [{"const": i}, score], "minItems": 2, "maxItems": 2, "items": False}
             for i in range(n_candidates)]
    schema = {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "maxLength": max_reasoning_chars},
            "ranking": {"type": "array", "items": candidate_id, "maxItems": n_candidates},
            "relevance_scores": {"type": "array", "prefixItems": pairs, "minItems": n_candidates,
                                 "maxItems": n_candidates, "items": False},
        },
        "required": ["reasoning", "ranking", "relevance_scores"],
    }
    return {"type": "json_schema", "json_schema": {"name": "lattice_slate", "schema": schema}}


def slate_prompt(query: str, candidates: Sequence[str], leaf: bool, max_chars: int = 1200) -> str:
    """The user message for one slate; each candidate is cut to ``max_chars`` and shown on one line.

    >>> print(slate_prompt("who?", ["Ann: a person", "Bob"], leaf=False).split("Candidates:")[1].splitlines()[1:3])
    ['[0] Ann: a person', '[1] Bob']
    """
    lines = []
    for i, text in enumerate(candidates):
        flat = " ".join(text.split())
        lines.append(f"[{i}] {flat[:max_chars]}")
    template = LEAF_PROMPT if leaf else CLUSTER_PROMPT
    return template.format(query=" ".join(query.split()), candidates="\n".join(lines))


def slate_completion(scores: Sequence[float | None], reasoning: str = "", max_reasoning_chars: int = 400) -> str:
    """A scorer reply in the schema above, from scores by slate position (None: not scored, left out): what a
    distilled student learns to write for a slate. Scores are rounded to integers and the ranking is best first
    (ties by position), so every reply the parser reads back gives the same scores.

    >>> slate_completion([40.4, None, 90.0], "b")
    '{"reasoning": "b", "ranking": [2, 0], "relevance_scores": [[0, 40], [2, 90]]}'
    >>> parse_slate_reply(slate_completion([10, 70]), 2).scores
    {0: 10.0, 1: 70.0}
    """
    scored = [(i, int(round(float(s)))) for i, s in enumerate(scores) if s is not None]
    ranking = [i for i, s in sorted(scored, key=lambda item: (-item[1], item[0]))]
    return json.dumps({"reasoning": reasoning[:max_reasoning_chars], "ranking": ranking,
                       "relevance_scores": [[i, s] for i, s in scored]})


@dataclass
class SlateParse:
    """A parsed slate reply: ``scores`` by slate position (0-100, only valid ones), and what was wrong."""

    scores: dict[int, float] = field(default_factory=dict)
    reasoning: str = ""
    ranking: list[int] = field(default_factory=list)
    parsed: bool = False
    hallucinated: int = 0
    duplicate: int = 0
    missing: int = 0
    out_of_range: int = 0
    malformed_pairs: int = 0

    @property
    def problems(self) -> dict[str, int]:
        return {"hallucinated": self.hallucinated, "duplicate": self.duplicate, "missing": self.missing,
                "out_of_range": self.out_of_range, "malformed_pairs": self.malformed_pairs}


def parse_slate_reply(text: str, n_candidates: int) -> SlateParse:
    """Read a scorer reply for a slate of ``n_candidates``, keeping every usable score.

    Ids outside the slate are hallucinated (dropped, counted); a repeated id keeps its first score;
    candidates without a score are missing (the search leaves them unscored); scores outside [0, 100]
    are clipped and counted. ``parsed`` is False when no JSON object with ``relevance_scores`` is found.

    >>> p = parse_slate_reply('ok {"reasoning": "r", "ranking": [1], "relevance_scores": [[1, 90], [1, 5], '
    ...                       '[7, 50], [0, 140]]}', n_candidates=3)
    >>> p.scores, p.hallucinated, p.duplicate, p.missing, p.out_of_range
    ({1: 90.0, 0: 100.0}, 1, 1, 1, 1)
    """
    result = SlateParse()
    reply = next((obj for obj in map(loads_tolerant, reversed(json_objects(text)))
                  if obj is not None and "relevance_scores" in obj), None)
    if reply is None:
        result.missing = n_candidates
        return result
    result.parsed = True
    result.reasoning = str(reply.get("reasoning", ""))
    ranking = reply.get("ranking")
    ids = [as_int(i) for i in ranking] if isinstance(ranking, list) else []
    result.ranking = [i for i in ids if i is not None]
    pairs = reply["relevance_scores"]
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, dict):  # {"id": 0, "score": 80}, a common small-model variant
            pair = list(pair.values())
        position, score = (as_int(pair[0]), _as_float(pair[1])) if isinstance(pair, list) and len(pair) == 2 \
            else (None, None)
        if position is None or score is None or score != score:  # score != score: NaN
            result.malformed_pairs += 1
            continue
        if not 0 <= position < n_candidates:
            result.hallucinated += 1
        elif position in result.scores:
            result.duplicate += 1
        else:
            if not 0.0 <= score <= 100.0:
                result.out_of_range += 1
                score = min(max(score, 0.0), 100.0)
            result.scores[position] = score
    result.missing = n_candidates - len(result.scores)
    return result


def _as_float(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
