"""OpenAI ``response_format`` for the embedded engine: JSON output enforced while the model generates.

Asking a 135M model for JSON in the prompt is not enough: it writes prose around the object, unbalanced
braces or level names that are not in the enum. Here the grammar is enforced token by token with xgrammar
inside ``model.generate``: before each sampling step every token that cannot continue a valid document gets
a logit of -inf, so the reply parses and, for ``json_schema``, follows the schema (within what xgrammar
supports; it skips some keywords, e.g. ``not``).

Three parts, in the order a request meets them:

- ``grammar_spec(response_format)`` checks the request field and says what to compile: ``None`` (free text),
  ``"json_object"`` or the JSON Schema dict. Invalid input is a ``BadRequest`` naming the faulty part.
- ``GrammarCompilerCache`` (one per model) compiles specs against the model's vocabulary with a time limit
  and keeps the compiled grammars in an LRU cache: the same schema on every request compiles once.
- ``GrammarLogitsProcessor`` masks the logits of one ``generate`` call, row by row (a row may have no grammar),
  and ends each constrained row with its stop token as soon as the JSON is complete.

Usage::

    spec = grammar_spec(request.get("response_format"))
    grammar = grammars.compile(spec) if spec is not None else None
    proc = GrammarLogitsProcessor([grammar] * n, eos_token_id=tokenizer.eos_token_id)  # fresh per call
    model.generate(**batch, logits_processor=LogitsProcessorList([proc]), num_return_sequences=n)
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from transformers import LogitsProcessor

from overstory.serving.errors import BadRequest, NotReady

PARAM = "response_format"
JSON_OBJECT = "json_object"
_TYPES = ("text", "json_object", "json_schema")


def grammar_spec(response_format: dict | None) -> dict | str | None:
    """What to compile for an OpenAI ``response_format``: ``None`` for free text (absent or ``{"type": "text"}``),
    ``"json_object"`` for ``{"type": "json_object"}``, the schema dict for ``{"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``. ``strict`` is accepted and ignored: the
    grammar is always enforced. Raises ``BadRequest`` (``param="response_format"``) naming what is wrong.

    >>> grammar_spec(None), grammar_spec({"type": "text"}), grammar_spec({"type": "json_object"})
    (None, None, 'json_object')
    >>> grammar_spec({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}})
    {'type': 'integer'}
    >>> try:
    ...     grammar_spec({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}})
    ... except BadRequest as exc:
    ...     print(exc.param, "|", exc)
    response_format | response_format.json_schema.schema: 'strin' is not valid under any of the given schemas at type
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise BadRequest(f"response_format must be an object, got {type(response_format).__name__}", param=PARAM)
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise BadRequest(f"response_format.type must be one of {', '.join(map(repr, _TYPES))}, got {kind!r}",
                         param=PARAM)
    block = response_format.get("json_schema")
    if not isinstance(block, dict):
        raise BadRequest("response_format.json_schema is required with type 'json_schema': an object with 'name' "
                         "and 'schema'", param=PARAM)
    if "schema" not in block or block["schema"] is None:
        raise BadRequest("response_format.json_schema.schema is missing: give the JSON Schema the reply must follow",
                         param=PARAM)
    schema = block["schema"]
    if not isinstance(schema, dict):
        # JSON Schema also allows true/false as schemas; OpenAI (and xgrammar's converter) want an object
        raise BadRequest(f"response_format.json_schema.schema must be a JSON Schema object, got "
                         f"{type(schema).__name__}", param=PARAM)
    _check_schema(schema)
    return schema


def _check_schema(schema: dict) -> None:
    """Validate the schema against its meta-schema (the draft its ``$schema`` names, 2020-12 by default; an
    unknown ``$schema`` falls back to 2020-12)."""
    prefix = "response_format.json_schema.schema:"
    if "$schema" in schema and not isinstance(schema["$schema"], str):
        # validator_for looks the value up in a dict of drafts: a list or number would crash it, not answer 400
        raise BadRequest(f"{prefix} {schema['$schema']!r} is not of type 'string' at $schema", param=PARAM)
    validator = validator_for(schema, default=Draft202012Validator)
    try:
        validator.check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(part) for part in exc.path) or "the top level"
        raise BadRequest(f"{prefix} {exc.message} at {where}", param=PARAM) from None
    except RecursionError:
        # jsonschema recurses once per nesting level (and xgrammar's conversion slows down with depth too)
        raise BadRequest(f"{prefix} nested too deeply to check", param=PARAM) from None


def _cache_key(spec: dict | str) -> str:
    # Canonical JSON, so key order and spacing in the request do not defeat the cache.
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:  # only a spec that did not come through grammar_spec can be this deep
        raise BadRequest("response_format: the schema is nested too deeply", param=PARAM) from None


# xgrammar's C++ errors start with "[hh:mm:ss] /project/cpp/<file>.cc:<line>: "; the client needs the reason only.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgrammar_reason(exc: BaseException) -> str:
    text = _XGR_PREFIX.sub("", str(exc).strip())
    return text.splitlines()[0] if text else exc.__class__.__name__


class _CompileFailed(Exception):
    """xgrammar refused the spec; the message is its reason, turned into a fresh BadRequest for each waiter."""


class GrammarCompilerCache:
    """Compiles specs from ``grammar_spec`` for one tokenizer/model and keeps the last ``max_entries`` compiled
    grammars (LRU, keyed by the spec's canonical JSON). Thread-safe: the server compiles on request threads.

    ``vocab_size`` must be the model's (``model.config.vocab_size``, the width of its logits), which can exceed
    the tokenizer's: the token masks must cover every logit, or the extra ids would stay unmasked.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, compile_timeout_s: float = 10.0, max_entries: int = 256):
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is unbounded by default; ours is bounded, so one copy is enough.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
                                             cache_enabled=False)
        self.compile_timeout_s = compile_timeout_s
        self.max_entries = max_entries
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        # Compiles under way, by key: concurrent requests with one schema share one compile, and a schema that
        # timed out and is still compiling in the background is not started again by its retries.
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def compile(self, spec: dict | str) -> xgr.CompiledGrammar:
        """The compiled grammar for ``spec`` (``"json_object"`` or a JSON Schema dict), from the cache when there.

        ``json_object`` is xgrammar's JSON grammar restricted to an object at the top (its built-in JSON grammar
        also accepts a top-level array, which OpenAI's ``json_object`` excludes). Schemas compile with
        ``any_whitespace=False``: xgrammar then allows exactly one layout, ``{"a": 1, "b": [2, 3]}``, instead of
        arbitrary whitespace between tokens, in which small models get stuck writing newlines until
        ``max_tokens``; the compact layout also costs the fewest tokens and parses the same. Raises
        ``BadRequest`` when xgrammar refuses the spec; ``NotReady`` (a 503, which clients retry) when the compile
        outlasts ``compile_timeout_s``: the schema is valid, and on a busy machine an ordinary one (a 150k-token
        vocabulary) has taken longer than 10 s, so the time limit says "not yet", not "bad request".
        """
        key = _cache_key(spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                # A daemon thread, not an executor: a compile that never ends must not block interpreter exit.
                threading.Thread(target=self._run, args=(key, spec, future), name="xgrammar-compile",
                                 daemon=True).start()
        try:
            return future.result(timeout=self.compile_timeout_s)
        except FutureTimeout:
            # xgrammar cannot be interrupted: the compile goes on in its thread and is cached if it ever ends.
            raise NotReady(f"response_format: compiling the grammar has taken longer than {self.compile_timeout_s:g} s "
                           "so far (a busy machine or a complex schema); it goes on and is kept once done, so a retry "
                           "can succeed (this is not a hang of the server)", param=PARAM) from None
        except _CompileFailed as exc:
            raise BadRequest(f"response_format: the grammar compiler (xgrammar) cannot enforce this schema: {exc}",
                             param=PARAM) from None

    def _run(self, key: str, spec: dict | str, future: Future) -> None:
        try:
            grammar = self._compile_now(spec)
        except Exception as exc:  # xgrammar raises RuntimeError (C++) or ValueError (Python side)
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(_CompileFailed(_xgrammar_reason(exc)))
            return
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        future.set_result(grammar)

    def _compile_now(self, spec: dict | str) -> xgr.CompiledGrammar:
        if spec == JSON_OBJECT:
            # strict_mode=False: in strict mode {"type": "object"} would only admit {}, not any object.
            return self._compiler.compile_json_schema({"type": "object"}, any_whitespace=False, strict_mode=False)
        if isinstance(spec, dict):
            return self._compiler.compile_json_schema(spec, any_whitespace=False)
        raise _CompileFailed(f"unknown grammar spec {spec!r}")


class GrammarLogitsProcessor(LogitsProcessor):
    """Per-row grammar masks for ONE ``model.generate`` call (it keeps each row's parse state: make a new one for
    every call). ``grammars`` has one entry per batch row after ``num_return_sequences`` expansion, a
    ``CompiledGrammar`` or ``None`` (that row is left alone). Greedy and sampling both work; beam search does not
    (beams reorder rows between steps), nor assisted decoding.

    The matcher's stop tokens are ``eos_token_id`` (an id or the list ``generate`` stops on): once the JSON is
    complete only they are allowed, so the row ends right after its closing brace. After a row's matcher accepted
    its stop token (or ``generate`` stopped the row for another reason, e.g. a stop string, and pads it), the row
    may only produce stop or pad tokens, which ``generate`` replaces by padding anyway.

    If a matcher rejects a token the mask allowed (an xgrammar inconsistency; not expected), the row is not
    constrained any more and its index is added to ``rejected_rows``, instead of failing the whole batch: the
    caller can report that row's output as unconstrained.
    """

    def __init__(self, grammars: Sequence[xgr.CompiledGrammar | None], eos_token_id: int | Sequence[int],
                 pad_token_id: int | None = None):
        stop = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not stop:
            raise ValueError("eos_token_id must name at least one token")
        self.stop_token_ids = stop
        # Default xgrammar stop tokens come from the tokenizer (its eos); override them with what generate stops
        # on, so that a completed JSON ends the row in generate's eyes too.
        self._matchers: list[xgr.GrammarMatcher | None] = [
            None if g is None else xgr.GrammarMatcher(g, override_stop_tokens=stop) for g in grammars]
        self.rejected_rows: set[int] = set()
        self._ended: set[int] = set()  # rows generate stopped and pads; only stop/pad tokens from here on
        self._seen: int | None = None  # input length at the previous call; None before the first call
        constrained = [g for g in grammars if g is not None]
        self._vocab_size = constrained[0].tokenizer_info.vocab_size if constrained else 0
        self._bitmask = xgr.allocate_token_bitmask(len(grammars), max(self._vocab_size, 1))
        # The mask of a finished row: stop tokens and the pad token only.
        self._end_mask = torch.zeros(self._bitmask.shape[1], dtype=torch.int32)
        for token in {*stop, *([] if pad_token_id is None else [pad_token_id])}:
            if 0 <= token < self._vocab_size:
                self._set_bit(self._end_mask, token)

    @staticmethod
    def _set_bit(row: torch.Tensor, token: int) -> None:
        word = int(row[token >> 5]) | (1 << (token & 31))
        row[token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # keep it in int32 range

    def _allowed(self, row: int, token: int) -> bool:
        """Whether the mask applied at the previous step allowed ``token`` in ``row``."""
        return 0 <= token < self._vocab_size and (int(self._bitmask[row, token >> 5]) >> (token & 31)) & 1 == 1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != len(self._matchers):
            raise ValueError(f"GrammarLogitsProcessor was made for {len(self._matchers)} rows but generate runs "
                             f"{input_ids.shape[0]}: pass one grammar per row after num_return_sequences expansion "
                             "(beam search is not supported)")
        if self._seen is not None and input_ids.shape[1] <= self._seen:
            raise RuntimeError("GrammarLogitsProcessor called with no new token: it holds one generate call's "
                               "state, make a new one per call")
        new_tokens = input_ids[:, self._seen:].tolist() if self._seen is not None else None
        self._seen = input_ids.shape[1]

        masked: list[int] = []
        for row, matcher in enumerate(self._matchers):
            if matcher is None or row in self.rejected_rows:
                continue
            if new_tokens is not None and row not in self._ended:
                self._advance(row, matcher, new_tokens[row])
            if row in self.rejected_rows:
                continue
            if row in self._ended or matcher.is_terminated():
                self._bitmask[row] = self._end_mask
            else:
                matcher.fill_next_token_bitmask(self._bitmask, row)
            masked.append(row)
        if not masked:
            return scores
        self._apply(scores, masked)
        return scores

    def _advance(self, row: int, matcher: xgr.GrammarMatcher, tokens: list[int]) -> None:
        """Feed the row's tokens since the previous call (one, in plain decoding) to its matcher."""
        for token in tokens:
            if matcher.is_terminated():
                return  # what follows the accepted stop token is generate's padding
            if not self._allowed(row, token):
                # Our mask made this token impossible to pick, so generate put it there: the row was stopped
                # (stop string, another eos id) and is now padded.
                self._ended.add(row)
                return
            if not matcher.accept_token(token):
                self.rejected_rows.add(row)
                return

    def _apply(self, scores: torch.FloatTensor, rows: list[int]) -> None:
        bitmask = self._bitmask if scores.device.type == "cpu" else self._bitmask.to(scores.device, non_blocking=True)
        # torch_native off CPU: plain torch ops, no triton/CUDA kernel build needed; the vocabulary is small.
        backend = "cpu" if scores.device.type == "cpu" else "torch_native"
        xgr.apply_token_bitmask_inplace(scores, bitmask, vocab_size=min(self._vocab_size, scores.shape[-1]),
                                        indices=rows, backend=backend)
        if scores.shape[-1] > self._vocab_size:  # logits past the grammar's vocabulary are never valid
            scores[rows, self._vocab_size:] = float("-inf")
        # A processor that ran before this one (e.g. min_new_tokens holding back eos) may have removed every token
        # the grammar allows; an all -inf row would make sampling fail on NaN and greedy pick token 0. The grammar
        # wins: its tokens get equal logits.
        dead = [row for row, empty in zip(rows, torch.isneginf(scores[rows]).all(dim=-1).tolist()) if empty]
        for row in dead:
            allowed = self._unpack(self._bitmask[row]).to(scores.device)
            scores[row, : allowed.shape[0]] = torch.where(allowed, 0.0, float("-inf"))

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[: self._vocab_size].bool()
