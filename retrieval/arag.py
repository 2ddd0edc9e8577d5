"""A-RAG (arXiv 2602.03442, "A-RAG: agentic RAG with hierarchical retrieval interfaces") as a retrieval strategy.

The generator is an agent with three tools over a chunked corpus, the semantics of the released code
(github.com/Ayanami0730/arag):

- ``keyword_search(keywords, top_k=5)``: a chunk scores sum(occurrences(k) * len(k)) over the keywords,
  case-insensitive substrings; the top chunks come back as snippets, up to 5 sentences holding a keyword.
- ``semantic_search(query, top_k=5)``: sentences (longer than 10 characters) are embedded once at build time;
  the 3 * top_k sentences nearest the query are grouped by chunk, a chunk scores its best sentence.
- ``read_chunk(chunk_ids)``: full chunk texts; a chunk read before in the same question is only named, and ids
  are consecutive integers in corpus order, so the neighbours of chunk N are N - 1 and N + 1.

Chunks are runs of the hierarchy's sentences of one document, up to ``chunk_tokens`` (about 1,000 tokens, as in
the paper). The strategy takes the hierarchy a data job built (``build_hierarchies``, or a stored one) rather
than documents: retrieval sits below data_pipeline (tests/test_layers.py), and data flows from data jobs to
the runtime (DESIGN.md), so the sentence splits and token counts are the hierarchy's own.

A question with a document scope (QASPER's paper) gets the same tools restricted to those documents: searches
rank only their chunks, and read_chunk refuses another document's chunk, saying so.

The loop is ReAct over OpenAI tool calling against the ``generator`` role: a text reply is the final answer;
after ``max_turns`` replies with tools, or once the context the server last reported reaches
``max_context_tokens``, a last request without tools forces the answer. The paper executes one tool call per
turn, the released code every call of a reply: ``parallel_tool_calls`` picks. Small models call tools badly,
so arguments are repaired where the intent is clear and every slip is counted by kind (``coerce_arguments``).

Configs: none of its own; the evaluation harness builds it (the command is the harness's).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from overstory.core.config import ConfigError
from overstory.core.records import Chunk
from overstory.retrieval.answer import clean_answer
from overstory.retrieval.index import DenseIndex
from overstory.retrieval.strategy import StrategyAnswer, raise_if_refused
from overstory.serving.client import Client, ClientError
from overstory.serving.tools import CALL_OPEN

# The released code's constants.
DEFAULT_TOP_K = 5
MAX_TOP_K = 20
SNIPPETS_PER_CHUNK = 5
MIN_SENTENCE_CHARS = 10  # sentences of this many characters or fewer are not embedded
SENTENCES_PER_RESULT = 3  # semantic_search ranks the top SENTENCES_PER_RESULT * top_k sentences


@dataclass(frozen=True)
class ARagConfig:
    chunk_tokens: int = 1000  # a chunk is a run of one document's sentences up to this many tokens
    max_turns: int = 15  # replies with tools offered; then the answer is forced (0: answer at once)
    # the forced answer also comes once the context (prompt + completion tokens of the server's latest reply)
    # reaches this many tokens; the released code's default. 0: answer at once, without tools
    max_context_tokens: int = 128_000
    max_tokens: int = 512  # per reply: a tool call or a short answer
    parallel_tool_calls: bool = False  # False: one call per turn (the paper); True: every call of a reply (the code)
    # tool_choice of the first turn: "auto" lets the model answer at once (the paper); "required" makes the server
    # constrain the first reply to a tool call, for small models that otherwise answer from memory without looking
    first_tool_choice: Literal["auto", "required"] = "auto"
    embed_batch_size: int = 256  # sentences per embedding request at build time

    def __post_init__(self) -> None:
        for key in ("chunk_tokens", "max_tokens", "embed_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"arag.{key} must be at least 1, got {getattr(self, key)}")
        for key in ("max_turns", "max_context_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"arag.{key} must be at least 0, got {getattr(self, key)}")


# ------------------------------------------------------------------------------------------------ the tools

# The bounds (list lengths, string lengths, top_k's range) are not the released code's: a model that keeps within
# them is unaffected, and under a constrained decoder (tool_choice "required") they keep a small model's call from
# running on until max_tokens cuts it off (SmolLM2-135M repeats keywords without end).
_TOP_K = {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K,
          "description": f"how many chunks to return (default {DEFAULT_TOP_K}, at most {MAX_TOP_K})"}
TOOLS = [
    {"type": "function", "function": {
        "name": "keyword_search",
        "description": "Find chunks containing exact keywords (case-insensitive). Use short specific terms of 1-3 "
                       "words, such as names or dates, not questions. Returns chunk ids with snippets.",
        "parameters": {"type": "object", "properties": {
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 5,
                         "description": "e.g. [\"Einstein\", \"1905\"]"},
            "top_k": _TOP_K}, "required": ["keywords"]}}},
    {"type": "function", "function": {
        "name": "semantic_search",
        "description": "Find chunks by meaning, when the exact words are unknown. Returns chunk ids with the "
                       "matching sentences.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 200, "description": "what you are looking for, in plain words"},
            "top_k": _TOP_K}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "read_chunk",
        "description": "Read the full text of chunks. Search results are only snippets: read a chunk before "
                       "relying on it. Chunk N's neighbours in its document are N-1 and N+1.",
        "parameters": {"type": "object", "properties": {
            "chunk_ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5,
                          "description": "e.g. [3, 4]"}},
            "required": ["chunk_ids"]}}},
]
# the chat template's tool tags, which small models copy into their replies instead of answering
_TEMPLATE_TAG = re.compile(r"</?tool_(?:call|response)>")
# the start of a call written as bare JSON
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:keyword_search|semantic_search|read_chunk)"')
# the argument each tool cannot run without
REQUIRED = {"keyword_search": "keywords", "semantic_search": "query", "read_chunk": "chunk_ids"}

SYSTEM_PROMPT = (
    "You answer questions about a document corpus that you see only through tools: keyword_search finds chunks "
    "containing exact words, semantic_search finds chunks by meaning, read_chunk returns a chunk's full text. "
    "Work step by step: search, read the promising chunks, search again for what is still missing (one hop at "
    "a time for questions that chain facts). When you know the answer, reply with the answer only: a few "
    "words, no explanation."
)
FORCE_PROMPT = ("You cannot call tools any more. Answer now from what you have read: the answer only, a few "
                "words, no explanation.")
UNPARSED_PROMPT = ("Your tool call could not be read. Call one of the tools with its arguments as a JSON object, "
                   "or reply with the answer only.")


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    chunk_ids: list[int]  # the chunks returned (searches) or newly read (read_chunk)
    tokens: int  # tokens of the text taken from the corpus (snippets or chunks); 0 for notices


# ------------------------------------------------------------------------------------------- pure functions


def pack(token_counts: Sequence[int], budget: int) -> list[range]:
    """Greedy runs of consecutive items whose token counts sum to at most ``budget``; an item over budget forms
    a run of its own (A-RAG's chunks: sentences up to about 1,000 tokens).

    >>> [list(run) for run in pack([400, 500, 300, 1200, 10], 1000)]
    [[0, 1], [2], [3], [4]]
    """
    runs: list[range] = []
    total = 0
    for i, n in enumerate(token_counts):
        if runs and total + n <= budget:
            runs[-1] = range(runs[-1].start, i + 1)
            total += n
        else:
            runs.append(range(i, i + 1))
            total = n
    return runs


def keyword_score(text: str, keywords: Sequence[str]) -> int:
    """A-RAG's keyword score: the sum over keywords of (case-insensitive occurrences in ``text``) x (keyword
    length), so a long, specific keyword outweighs a short one.

    >>> keyword_score("Paris is a capital. PARIS, France.", ["paris", "France", "Berlin"])
    16
    """
    lowered = text.lower()
    return sum(lowered.count(keyword.lower()) * len(keyword) for keyword in keywords)


def rank_by_best_sentence(hits: Sequence[tuple[int, float]], top_k: int) -> list[tuple[int, float, list[int]]]:
    """Chunks ranked by their best sentence. ``hits`` are (chunk, similarity) of retrieved sentences; returns
    (chunk, best similarity, positions in ``hits`` of the chunk's sentences), best first (ties keep the order
    of first appearance), ``top_k`` of them.

    >>> rank_by_best_sentence([(0, 0.6), (1, 0.7), (0, 0.8), (2, 0.1)], top_k=2)
    [(0, 0.8, [0, 2]), (1, 0.7, [1])]
    """
    positions: dict[int, list[int]] = {}
    for position, (chunk, _) in enumerate(hits):
        positions.setdefault(chunk, []).append(position)
    best = {chunk: max(hits[p][1] for p in found) for chunk, found in positions.items()}
    ranked = sorted(positions, key=lambda chunk: -best[chunk])[:top_k]
    return [(chunk, best[chunk], positions[chunk]) for chunk in ranked]


def coerce_arguments(name: Any, arguments: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """The arguments of a call of tool ``name`` as the tool takes them, repaired where the intent is clear, and
    the kinds of slip found; None when the call cannot run. Kinds:

    - ``unknown_tool``: no such tool (cannot run)
    - ``bad_arguments``: not a JSON object (cannot run); ``arguments_as_string``: an object JSON-encoded twice
    - ``missing_argument``: the required argument is absent (cannot run)
    - ``not_a_list``: a single value where a list belongs (``"Nile, Egypt"`` -> ``["Nile", "Egypt"]``, ``3`` -> ``[3]``)
    - ``bad_value``: a value of the wrong kind: skipped (a chunk id without a number), replaced by the default (a
      top_k that is no number) or, when nothing usable is left of the required argument, the call cannot run

    Integer chunk ids written as strings (``"3"``, the released code's own schema) and top_k outside 1..20
    (clamped) are taken as they are, without counting.

    >>> coerce_arguments("read_chunk", '{"chunk_ids": [3, "4"]}')
    ({'chunk_ids': [3, 4]}, [])
    >>> coerce_arguments("keyword_search", json.dumps(json.dumps({"keywords": "Nile, Egypt", "top_k": "x"})))
    ({'keywords': ['Nile', 'Egypt'], 'top_k': 5}, ['arguments_as_string', 'not_a_list', 'bad_value'])
    >>> coerce_arguments("semantic_search", {"top_k": 2}), coerce_arguments("search", {})
    ((None, ['missing_argument']), (None, ['unknown_tool']))
    """
    if name not in REQUIRED:
        return None, ["unknown_tool"]
    kinds: list[str] = []
    arguments = _arguments_object(arguments, kinds)
    if arguments is None:
        return None, kinds
    if REQUIRED[name] not in arguments:
        return None, [*kinds, "missing_argument"]
    value = arguments[REQUIRED[name]]
    if name == "read_chunk":
        coerced: dict[str, Any] = {"chunk_ids": _chunk_ids(value, kinds)}
    elif name == "keyword_search":
        coerced = {"keywords": _keywords(value, kinds), "top_k": _top_k(arguments.get("top_k"), kinds)}
    else:
        coerced = {"query": _query(value, kinds), "top_k": _top_k(arguments.get("top_k"), kinds)}
    if not coerced[REQUIRED[name]]:
        return None, kinds if "bad_value" in kinds else [*kinds, "bad_value"]
    return coerced, kinds


def _arguments_object(arguments: Any, kinds: list[str]) -> dict[str, Any] | None:
    """A dict from a dict, a JSON object, or a JSON string of a JSON object; no arguments at all read as {}."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        arguments = _json(arguments)
        if isinstance(arguments, str):
            kinds.append("arguments_as_string")
            arguments = _json(arguments)
    if isinstance(arguments, dict):
        return arguments
    kinds.append("bad_arguments")
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_list(value: Any, kinds: list[str]) -> list[Any]:
    """A list as is; a string holding a JSON list, or comma-separated items; any other value alone."""
    if isinstance(value, list):
        return value
    kinds.append("not_a_list")
    if not isinstance(value, str):
        return [value]
    parsed = _json(value)
    return parsed if isinstance(parsed, list) else value.split(",")


def _chunk_ids(value: Any, kinds: list[str]) -> list[int]:
    ids = []
    for item in _as_list(value, kinds):
        number = item if isinstance(item, int) and not isinstance(item, bool) else _integer(item)
        if number is None:
            kinds.append("bad_value")
        else:
            ids.append(number)
    return ids


def _integer(value: Any) -> int | None:
    """The integer a string or a whole float spells (" 3", "chunk 3", 3.0); None otherwise."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    found = re.fullmatch(r"\s*(?:chunk\s*)?(-?\d+)\s*", value, re.IGNORECASE) if isinstance(value, str) else None
    return int(found.group(1)) if found else None


def _keywords(value: Any, kinds: list[str]) -> list[str]:
    words = [str(k).strip() for k in _as_list(value, kinds) if isinstance(k, str | int | float)]
    return [w for w in words if w]


def _query(value: Any, kinds: list[str]) -> str:
    if isinstance(value, str):
        return value.strip()
    kinds.append("bad_value")
    return " ".join(str(v) for v in value).strip() if isinstance(value, list) else ""


def _top_k(value: Any, kinds: list[str]) -> int:
    if value is None:
        return DEFAULT_TOP_K
    number = value if isinstance(value, int) and not isinstance(value, bool) else _integer(value)
    if number is None:
        kinds.append("bad_value")
        return DEFAULT_TOP_K
    return min(max(number, 1), MAX_TOP_K)


def chunk_corpus(hierarchy: Sequence[Chunk], chunk_tokens: int) -> list[tuple[Chunk, list[Chunk]]]:
    """A-RAG's chunks, in corpus order, each with its sentences: per document (in the hierarchy's order), runs of
    consecutive sentences up to ``chunk_tokens`` (``pack``). A chunk's text is its document's text from its first
    sentence's start to its last one's end; its level is "section", the hierarchy's name for spans of about a
    thousand tokens (HierarchyConfig.section_tokens); n_tokens sums its sentences' (whitespace between them is
    not counted)."""
    documents = {c.doc_id: c for c in hierarchy if c.level == "document"}
    sentences: dict[str, list[Chunk]] = {doc_id: [] for doc_id in documents}
    for chunk in hierarchy:
        if chunk.level == "sentence":
            if chunk.doc_id not in sentences:
                raise ValueError(f"the hierarchy has sentences of {chunk.doc_id!r} but not its document chunk")
            sentences[chunk.doc_id].append(chunk)
    chunks = []
    for doc_id, document in documents.items():
        ordered = sorted(sentences[doc_id], key=lambda s: s.start)
        for j, run in enumerate(pack([s.n_tokens for s in ordered], chunk_tokens)):
            members = ordered[run.start:run.stop]
            chunks.append((_joined(document, members, j), members))
    return chunks


def _joined(document: Chunk, sentences: list[Chunk], j: int) -> Chunk:
    start, end = sentences[0].start, sentences[-1].end
    return Chunk(id=f"{document.doc_id}#chunk{j}", doc_id=document.doc_id, level="section",
                 text=document.text[start - document.start:end - document.start], parent=document.id,
                 children=[s.id for s in sentences], start=start, end=end,
                 n_tokens=sum(s.n_tokens for s in sentences), title=document.title)


# ------------------------------------------------------------------------------------------------- strategy


@dataclass
class _Question:
    """What one question's loop has done so far."""

    messages: list[dict[str, Any]]
    scope: Sequence[str] | None = None  # the documents the question is about; None: the whole corpus
    read: list[int] = field(default_factory=list)  # chunks read in full, in reading order
    found: list[int] = field(default_factory=list)  # chunks returned by searches, in order, repeats included
    failures: Counter = field(default_factory=Counter)
    calls: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    context_tokens: int = 0
    retrieved_tokens: int = 0


class ARagStrategy:
    """A-RAG over a chunked corpus; ``build`` chunks and indexes it, ``answer`` runs the agent for a question."""

    name = "arag"

    def __init__(self, chunks: list[tuple[Chunk, list[Chunk]]], index: DenseIndex, config: ARagConfig):
        self.chunks = [chunk for chunk, _ in chunks]  # chunk id N (what the model sees) is self.chunks[N]
        self.sentences = [sentences for _, sentences in chunks]
        self.chunk_of = {s.id: n for n, sentences in enumerate(self.sentences) for s in sentences}
        self.chunks_of_document: dict[str, list[int]] = {}
        for n, chunk in enumerate(self.chunks):
            self.chunks_of_document.setdefault(chunk.doc_id, []).append(n)
        self.index = index  # the embedded sentences
        self.config = config

    @classmethod
    def build(cls, hierarchy: Sequence[Chunk], client: Client, config: ARagConfig | None = None) -> ARagStrategy:
        """Chunk the corpus of ``hierarchy`` (``build_hierarchies`` or a stored one: its document and sentence
        chunks are used) and embed its sentences through ``client``'s embedder, once."""
        config = config or ARagConfig()
        chunks = chunk_corpus(hierarchy, config.chunk_tokens)
        # bare sentences, as the released code embeds them (the index would otherwise prefix the title)
        indexed = [replace(s, title="") for _, sentences in chunks for s in sentences
                   if len(s.text) > MIN_SENTENCE_CHARS]
        index = DenseIndex.build(indexed, lambda texts: client.embed("embedder", texts), config.embed_batch_size)
        return cls(chunks, index, config)

    # ---- the tools

    def in_scope(self, scope: Sequence[str] | None) -> list[int]:
        """The chunk ids of the documents ``scope`` names, in corpus order; every chunk id when it is None."""
        if scope is None:
            return list(range(len(self.chunks)))
        return sorted(n for doc_id in set(scope) for n in self.chunks_of_document.get(doc_id, []))

    def keyword_search(self, keywords: Sequence[str], top_k: int = DEFAULT_TOP_K,
                       scope: Sequence[str] | None = None) -> ToolResult:
        """The chunks (of ``scope``'s documents, when given) with the highest keyword score, with snippets."""
        scores = {n: keyword_score(self.chunks[n].text, keywords) for n in self.in_scope(scope)}
        ranked = sorted((n for n, score in scores.items() if score > 0), key=lambda n: -scores[n])[:top_k]
        if not ranked:
            return ToolResult(f"No chunk contains any of the keywords {list(keywords)}.", [], 0)
        lowered = [k.lower() for k in keywords]
        snippets = {n: [s for s in self.sentences[n] if any(k in s.text.lower() for k in lowered)][:SNIPPETS_PER_CHUNK]
                    for n in ranked}
        return self._search_result(ranked, snippets, {})

    def semantic_search(self, query: str, client: Client, top_k: int = DEFAULT_TOP_K,
                        scope: Sequence[str] | None = None) -> ToolResult:
        """The chunks (of ``scope``'s documents, when given) by their best sentence; the query is embedded through
        ``client`` (the question's own, so its cost is counted)."""
        hits = self.index.search([query], SENTENCES_PER_RESULT * top_k,
                                 embed=lambda texts: client.embed("embedder", texts), doc_ids=scope)[0]
        ranked = rank_by_best_sentence([(self.chunk_of[hit.chunk.id], hit.score) for hit in hits], top_k)
        if not ranked:
            return ToolResult(f"No results for {query!r}.", [], 0)
        snippets = {n: sorted((hits[p].chunk for p in positions), key=lambda s: s.start) for n, _, positions in ranked}
        return self._search_result([n for n, _, _ in ranked], snippets, {n: score for n, score, _ in ranked})

    def _search_result(self, ranked: list[int], snippets: dict[int, list[Chunk]],
                       similarity: dict[int, float]) -> ToolResult:
        lines = []
        for n in ranked:
            score = f" (similarity {similarity[n]:.3f})" if n in similarity else ""
            text = "... " + " ... ".join(s.text for s in snippets[n]) + " ..." if snippets[n] else "(no sentence match)"
            lines.append(f"{self._label(n)}{score}: {text}")
        tokens = sum(s.n_tokens for n in ranked for s in snippets[n])
        return ToolResult("\n\n".join(lines), ranked, tokens)

    def read_chunk(self, chunk_ids: Sequence[int], already_read: Sequence[int] = (),
                   scope: Sequence[str] | None = None) -> ToolResult:
        """Full texts of ``chunk_ids``; those in ``already_read`` (or earlier in ``chunk_ids``) are only named,
        and cost no tokens; an id outside the corpus, or outside ``scope``'s documents when given, gets a message
        saying so."""
        seen, parts, new = set(already_read), [], []
        allowed = None if scope is None else set(self.in_scope(scope))
        for n in chunk_ids:
            if not 0 <= n < len(self.chunks):
                parts.append(f"Chunk {n} does not exist: chunk ids run from 0 to {len(self.chunks) - 1}.")
            elif allowed is not None and n not in allowed:
                parts.append(f"Chunk {n} is not in the document this question is about.")
            elif n in seen:
                parts.append(f"Chunk {n} was already read.")
            else:
                seen.add(n)
                new.append(n)
                parts.append(f"{self._label(n)}:\n{self.chunks[n].text}")
        return ToolResult("\n\n".join(parts), new, sum(self.chunks[n].n_tokens for n in new))

    def _label(self, n: int) -> str:
        title = self.chunks[n].title
        return f"Chunk {n} ({title})" if title else f"Chunk {n}"

    # ---- the loop

    def answer(self, question: str, client: Client, scope: Sequence[str] | None = None) -> StrategyAnswer:
        """Run the agent on ``question`` (its tools restricted to ``scope``'s documents, when given), every request
        through ``client``; never raises for a bad reply or a transient request failure (``failure`` says what went
        wrong); a request the server refuses (a 4xx) raises ``RequestRefused``."""
        state = _Question([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                          scope)
        try:
            raw, stopped_by = self._react(state, client)
        except ClientError as exc:
            raise_if_refused(exc, "A-RAG's agent or its tools (roles 'generator', 'embedder')")
            return self._result(state, "", "request_failed", failure="request_failed", failure_detail=str(exc))
        prediction = "" if CALL_OPEN in raw else clean_answer(_TEMPLATE_TAG.sub("", raw))
        if not prediction:  # empty, or a tool call written where the answer was asked for
            return self._result(state, raw, stopped_by, failure="no_answer", failure_detail=raw)
        return self._result(state, raw, stopped_by, prediction=prediction)

    def _react(self, state: _Question, client: Client) -> tuple[str, str]:
        """Turns until the model answers in text, or a limit forces the answer: (final reply, what stopped)."""
        for turn in range(self.config.max_turns):
            if state.context_tokens >= self.config.max_context_tokens:
                return self._forced_answer(state, client), "budget"
            choice = self.config.first_tool_choice if turn == 0 else "auto"
            reply = client.chat("generator", state.messages, tools=TOOLS, tool_choice=choice,
                                parallel_tool_calls=self.config.parallel_tool_calls,
                                max_tokens=self.config.max_tokens, temperature=0)
            state.turns += 1
            state.context_tokens = reply.usage.get("prompt_tokens", 0) + reply.usage.get("completion_tokens", 0)
            calls = reply.tool_calls
            if not calls and CALL_OPEN in reply.text:
                state.failures["unparsed_call"] += 1  # tagged, but the server could not read the call
            elif not calls:
                calls = _text_calls(reply.text)
                if calls:
                    state.failures["untagged_call"] += 1
                elif _CALL_START.match(reply.text):
                    state.failures["truncated_call"] += 1  # a call cut off (max_tokens) before its JSON closed
                elif _TEMPLATE_TAG.search(reply.text) and not _TEMPLATE_TAG.sub("", reply.text).strip():
                    state.failures["template_echo"] += 1  # only the chat template's tags, copied: no answer
                else:
                    return reply.text, "answer"
            self._take_turn(state, reply.text, calls, client)
        return self._forced_answer(state, client), "max_turns"

    def _forced_answer(self, state: _Question, client: Client) -> str:
        state.messages.append({"role": "user", "content": FORCE_PROMPT})
        return client.chat("generator", state.messages, max_tokens=self.config.max_tokens, temperature=0).text

    def _take_turn(self, state: _Question, text: str, calls: list[dict[str, Any]], client: Client) -> None:
        """Run the reply's tool calls (the first only unless parallel_tool_calls) and add the reply and results
        to the conversation. A reply without a call it could run gets a reminder instead."""
        calls = calls if self.config.parallel_tool_calls else calls[:1]
        if not calls:
            state.messages += [{"role": "assistant", "content": text}, {"role": "user", "content": UNPARSED_PROMPT}]
            return
        done = [self._call(state, call, client, i) for i, call in enumerate(calls)]
        state.messages.append({"role": "assistant", "content": text, "tool_calls": [c for c, _ in done]})
        state.messages += [{"role": "tool", "tool_call_id": c["id"], "content": text} for c, text in done]

    def _call(self, state: _Question, call: Any, client: Client, i: int) -> tuple[dict[str, Any], str]:
        """Run one tool call: (the call as the history keeps it, with arguments a JSON object so any server
        accepts the history back, the result text)."""
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        name = function.get("name") if isinstance(function.get("name"), str) else "unknown"
        arguments, kinds = coerce_arguments(name, function.get("arguments"))
        state.failures.update(kinds)
        state.calls.append({"turn": state.turns, "name": name, "arguments": arguments, "problems": kinds})
        text = self._run_tool(state, name, arguments, client) if arguments else _refusal(name, kinds)
        call_id = call.get("id") if isinstance(call, dict) and isinstance(call.get("id"), str) else None
        kept = {"id": call_id or f"call_{state.turns}_{i}", "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments or {})}}
        return kept, text

    def _run_tool(self, state: _Question, name: str, arguments: dict[str, Any], client: Client) -> str:
        if name == "read_chunk":
            result = self.read_chunk(arguments["chunk_ids"], state.read, state.scope)
            state.read += result.chunk_ids
        else:
            result = (self.keyword_search(**arguments, scope=state.scope) if name == "keyword_search"
                      else self.semantic_search(arguments["query"], client, arguments["top_k"], state.scope))
            state.found += result.chunk_ids
        state.retrieved_tokens += result.tokens
        return result.text

    def _result(self, state: _Question, raw: str, stopped_by: str, prediction: str = "", **failure: str
                ) -> StrategyAnswer:
        """The answer with its evidence: the chunks read in full, in reading order, then the chunks searches
        returned that were not read, in the order returned. What the agent read is what it answered from, so it
        ranks first, and recall@k at a small k measures the reading; the search results it saw only as snippets
        still count at a larger k."""
        order = list(dict.fromkeys(state.read + state.found))
        details = {"turns": state.turns, "stopped_by": stopped_by, "tool_failures": dict(state.failures),
                   "calls": state.calls, "chunks_read": state.read, "retrieved_tokens": state.retrieved_tokens,
                   "context_tokens": state.context_tokens}
        return StrategyAnswer(prediction=prediction, raw=raw, evidence=[self.chunks[n] for n in order],
                              details=details, **failure)


def _text_calls(text: str) -> list[dict[str, Any]]:
    """A call the model wrote as bare JSON (``{"name": "keyword_search", "arguments": {...}}`` without the
    template's tags, so the server left it as text), in OpenAI's shape; [] when the text is not one."""
    value = _json(text.strip())
    if isinstance(value, dict) and value.get("name") in REQUIRED:
        return [{"type": "function", "function": {"name": value["name"], "arguments": value.get("arguments")}}]
    return []


def _refusal(name: str, kinds: list[str]) -> str:
    """The tool message for a call that cannot run, saying what to fix."""
    if "unknown_tool" in kinds:
        return f"Error: there is no tool {name!r}; the tools are {', '.join(REQUIRED)}."
    if "bad_arguments" in kinds:
        return "Error: the arguments must be a JSON object."
    if "missing_argument" in kinds:
        return f"Error: {name} needs the argument {REQUIRED[name]!r}."
    return f"Error: the argument {REQUIRED[name]!r} of {name} holds nothing usable."
