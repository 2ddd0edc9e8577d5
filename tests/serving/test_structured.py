"""response_format enforced with xgrammar (serving/structured.py): request checks, the compile cache and its time
limit, the logits processor row by row, and real SmolLM2 generation through ``model.generate`` (left-padded
mixed batches, greedy and sampled, num_return_sequences, the planner prompts of the shipped SQuAD sample)."""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import DynamicCache, LogitsProcessorList

from overstory.core.records import LEVELS
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.pseudo_labels import round_robin_by_document, single_document_questions
from overstory.models.planner import document_metadata, planner_messages, strict_plan_valid
from overstory.models.registry import SMOLLM2, load_tokenizer
from overstory.serving.errors import BadRequest, NotReady
from overstory.serving.structured import GrammarCompilerCache, GrammarLogitsProcessor, grammar_spec

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 49152  # SmolLM2's model.config.vocab_size
LEVEL_SCHEMA = {"type": "object",
                "properties": {"level_min": {"enum": list(LEVELS)}, "level_max": {"enum": list(LEVELS)}},
                "required": ["level_min", "level_max"], "additionalProperties": False}
# The planner's answer as strict_plan_valid wants it, including smallest <= largest: one branch per largest size.
PLAN_SCHEMA = {"anyOf": [{"type": "object",
                          "properties": {"largest_chunk_size": {"const": level},
                                         "smallest_chunk_size": {"enum": list(LEVELS[: i + 1])}},
                          "required": ["largest_chunk_size", "smallest_chunk_size"], "additionalProperties": False}
                         for i, level in enumerate(LEVELS)]}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "plan", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def compilers(tokenizer) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def smollm(smollm2: tuple):
    model, tokenizer = smollm2  # the package's copy (conftest.py)
    assert model.config.vocab_size == VOCAB
    return model, tokenizer


# --- grammar_spec -------------------------------------------------------------------------------------------------

def test_text_or_absent_format_is_unconstrained() -> None:
    assert grammar_spec(None) is None
    assert grammar_spec({"type": "text"}) is None


def test_json_object_and_json_schema_specs() -> None:
    assert grammar_spec({"type": "json_object"}) == "json_object"
    assert grammar_spec(schema_format(LEVEL_SCHEMA)) == LEVEL_SCHEMA
    assert grammar_spec(schema_format(PLAN_SCHEMA)) == PLAN_SCHEMA


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}},
     "'strin' is not valid under any of the given schemas at properties.a.type"),
    ({"type": "object", "required": "a"}, "'a' is not of type 'array' at required"),
    ({"type": 5}, "at type"),
    # the draft named in $schema is the one checked: draft-07 wants items to be a schema or a list of schemas
    ({"$schema": "http://json-schema.org/draft-07/schema#", "items": [{"type": "strin"}]}, "at items"),
])
def test_invalid_schema_names_the_problem_and_where(schema: dict, where: str) -> None:
    with pytest.raises(BadRequest) as caught:
        grammar_spec(schema_format(schema))
    assert caught.value.param == "response_format"
    assert str(caught.value).startswith("response_format.json_schema.schema: ")
    assert str(caught.value).endswith(where)


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("response_format, message", [
    (schema_format({"$schema": ["draft-07"]}), "\\['draft-07'\\] is not of type 'string' at \\$schema"),
    (schema_format({"$schema": 7, "type": "integer"}), "7 is not of type 'string' at \\$schema"),
    (schema_format(_nested(2000)), "json_schema.schema: nested too deeply to check"),
    ({"type": "json_schema", "json_schema": {"name": "plan"}}, "response_format.json_schema.schema is missing"),
    ({"type": "json_schema", "json_schema": {"name": "plan", "schema": None}}, "json_schema.schema is missing"),
    ({"type": "json_schema"}, "response_format.json_schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "plan", "schema": True}}, "must be a JSON Schema object"),
    ({"type": "xml"}, "response_format.type must be one of 'text', 'json_object', 'json_schema', got 'xml'"),
    ({}, "got None"),
    ("json_object", "response_format must be an object, got str"),
])
def test_malformed_response_format(response_format, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        grammar_spec(response_format)
    assert caught.value.param == "response_format"


# --- GrammarCompilerCache -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, reason", [
    ({"type": "integer", "minimum": 5, "maximum": 1}, "Invalid range: minimum greater than maximum"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems is greater than maxItems: 3 > 1"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(?<=a)b"}, "Lookbehind is not supported"),
])
def test_schema_xgrammar_refuses_is_a_bad_request(compilers: GrammarCompilerCache, schema: dict, reason: str) -> None:
    grammar_spec(schema_format(schema))  # valid JSON Schema: only the compiler can refuse it
    with pytest.raises(BadRequest, match="xgrammar") as caught:
        compilers.compile(schema)
    assert caught.value.param == "response_format"
    assert reason in str(caught.value)
    assert "/project/cpp" not in str(caught.value)  # xgrammar's source location is stripped


def test_cache_is_keyed_by_canonical_json_and_bounded(compilers: GrammarCompilerCache, tokenizer) -> None:
    reordered = json.loads(json.dumps(LEVEL_SCHEMA), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    assert list(reordered) != list(LEVEL_SCHEMA)
    assert compilers.compile(LEVEL_SCHEMA) is compilers.compile(reordered)
    assert compilers.compile("json_object") is compilers.compile("json_object")

    small = GrammarCompilerCache(tokenizer, VOCAB, max_entries=2)
    first = small.compile({"type": "integer"})
    small.compile({"type": "string"})
    assert small.compile({"type": "integer"}) is first  # a hit refreshes it...
    small.compile({"type": "boolean"})  # ...so the string grammar is the one evicted
    assert len(small) == 2 and small.compile({"type": "integer"}) is first


class _SlowCompiler:
    """Stands in for xgrammar's compiler: blocks until released, counting calls; ``finished`` is set once a compile
    has returned."""

    def __init__(self, real: xgr.GrammarCompiler) -> None:
        self.real, self.calls, self.release, self.finished = real, 0, threading.Event(), threading.Event()

    def compile_json_schema(self, schema, **kwargs):
        self.calls += 1
        self.release.wait(timeout=30)
        compiled = self.real.compile_json_schema(schema, **kwargs)
        self.finished.set()
        return compiled


def test_compile_timeout_is_not_ready_yet_and_the_compile_is_not_restarted(tokenizer) -> None:
    """A compile past its limit is a 503 to retry (the schema is valid; a busy machine made it slow), and the retry
    waits on the same compile, which is kept once it ends."""
    cache = GrammarCompilerCache(tokenizer, VOCAB, compile_timeout_s=0.2)
    slow = cache._compiler = _SlowCompiler(cache._compiler)
    try:
        for _ in range(2):  # the retry waits on the same compile instead of starting another
            with pytest.raises(NotReady, match="longer than 0.2 s.*retry can succeed") as caught:
                cache.compile(LEVEL_SCHEMA)
            assert not slow.finished.is_set()  # the limit answered, not the end of the (still blocked) compile
            assert caught.value.param == "response_format"
        assert slow.calls == 1
    finally:
        slow.release.set()
    deadline = time.monotonic() + 10
    while len(cache) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(cache.compile(LEVEL_SCHEMA), xgr.CompiledGrammar)  # it finished late and was kept
    assert slow.calls == 1


def test_concurrent_requests_for_one_schema_compile_it_once(tokenizer) -> None:
    cache = GrammarCompilerCache(tokenizer, VOCAB)
    slow = cache._compiler = _SlowCompiler(cache._compiler)
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(cache.compile(PLAN_SCHEMA))) for _ in range(6)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    slow.release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert slow.calls == 1


def test_grammars_admit_only_compact_objects(compilers: GrammarCompilerCache) -> None:
    def accepts(grammar: xgr.CompiledGrammar, text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.is_completed()

    json_object = compilers.compile("json_object")
    assert accepts(json_object, '{"name": "Felix", "tags": [1, {"a": null}]}')
    assert not accepts(json_object, "[1, 2]")  # xgrammar's built-in JSON grammar would take a top-level array
    assert not accepts(json_object, '{\n"name": 1}')  # no free whitespace for the model to loop in
    plan = compilers.compile(PLAN_SCHEMA)
    assert accepts(plan, '{"largest_chunk_size": "section", "smallest_chunk_size": "sentence"}')
    assert not accepts(plan, '{"largest_chunk_size": "sentence", "smallest_chunk_size": "section"}')
    assert not accepts(plan, '{\n  "largest_chunk_size": "section", "smallest_chunk_size": "sentence"}')


# --- GrammarLogitsProcessor on hand-made steps --------------------------------------------------------------------

def _finite(scores: torch.Tensor, row: int) -> set[int]:
    return set(torch.isfinite(scores[row]).nonzero().flatten().tolist())


class _Steps:
    """Drives a processor as generate does: each call appends one token per row to input_ids."""

    def __init__(self, processor: GrammarLogitsProcessor, rows: int, prompt_len: int = 4) -> None:
        self.processor, self.ids = processor, torch.zeros((rows, prompt_len), dtype=torch.long)

    def __call__(self, next_tokens: list[int] | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
        if next_tokens is not None:
            self.ids = torch.cat([self.ids, torch.tensor(next_tokens).unsqueeze(1)], dim=1)
        scores = torch.zeros((self.ids.shape[0], VOCAB)) if scores is None else scores
        return self.processor(self.ids, scores)


def test_rows_are_masked_independently_and_end_with_eos(compilers: GrammarCompilerCache, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    schema = compilers.compile({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    proc = GrammarLogitsProcessor([schema, None, compilers.compile("json_object")], eos_token_id=eos)
    step = _Steps(proc, 3)
    scores = step()
    brace = tokenizer.convert_tokens_to_ids("{")
    assert brace in _finite(scores, 0) and brace in _finite(scores, 2)
    assert tokenizer("Hello", add_special_tokens=False).input_ids[0] not in _finite(scores, 0) | _finite(scores, 2)
    assert eos not in _finite(scores, 0) | _finite(scores, 2)  # nothing written yet: cannot stop
    assert len(_finite(scores, 1)) == VOCAB  # the unconstrained row is untouched

    body = tokenizer('{"a": 12}', add_special_tokens=False).input_ids
    free = tokenizer("Hi there", add_special_tokens=False).input_ids
    row0 = [*body, eos, eos]  # the object, its stop token, then generate's padding (pad = eos here)
    row2 = [brace, tokenizer.convert_tokens_to_ids("}"), eos] + [eos] * (len(row0) - 3)
    for i in range(len(row0)):
        assert row0[i] in _finite(scores, 0) and row2[i] in _finite(scores, 2)
        if i == len(body):
            assert _finite(scores, 0) == {eos}  # the object is complete: only the stop token
        scores = step([row0[i], free[i % len(free)], row2[i]])
    assert _finite(scores, 0) == {eos} and _finite(scores, 2) == {eos}  # terminated rows: stop/pad only
    assert len(_finite(scores, 1)) == VOCAB and proc.rejected_rows == set()


def test_a_rejected_token_frees_the_row_instead_of_failing(compilers: GrammarCompilerCache, tokenizer) -> None:
    proc = GrammarLogitsProcessor([compilers.compile("json_object")] * 2, eos_token_id=tokenizer.eos_token_id)
    step = _Steps(proc, 2)
    step()
    real = proc._matchers[0]

    class Refusing:  # a matcher that disagrees with its own mask, as an xgrammar bug would
        def __getattr__(self, name):
            return getattr(real, name)

        def accept_token(self, token: int) -> bool:
            return False

    proc._matchers[0] = Refusing()
    brace = tokenizer.convert_tokens_to_ids("{")
    scores = step([brace, brace])
    assert proc.rejected_rows == {0}
    assert len(_finite(scores, 0)) == VOCAB  # no longer constrained
    assert tokenizer.eos_token_id not in _finite(scores, 1)  # the other row still is


def test_a_row_generate_stopped_is_padded_not_rejected(compilers: GrammarCompilerCache, tokenizer) -> None:
    eos, pad = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")
    proc = GrammarLogitsProcessor([compilers.compile("json_object")], eos_token_id=eos, pad_token_id=pad)
    step = _Steps(proc, 1)
    step()
    step([tokenizer.convert_tokens_to_ids("{")])
    scores = step([pad])  # mid-object: the mask forbade it, so generate stopped the row (e.g. a stop string)
    assert proc.rejected_rows == set() and _finite(scores, 0) == {eos, pad}


def test_grammar_wins_over_processors_that_mask_everything(compilers: GrammarCompilerCache, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    proc = GrammarLogitsProcessor([compilers.compile({"type": "integer"})], eos_token_id=eos)
    step = _Steps(proc, 1)
    step()
    seven = tokenizer.convert_tokens_to_ids("7")
    held_back = torch.zeros((1, VOCAB))
    held_back[0, eos] = float("-inf")  # what min_new_tokens does; once "7" is written, eos is not the only choice
    scores = step([seven], held_back)
    assert eos not in _finite(scores, 0) and seven in _finite(scores, 0)
    hello = tokenizer("Hello", add_special_tokens=False).input_ids[0]
    nothing_allowed = torch.full((1, VOCAB), float("-inf"))
    nothing_allowed[0, hello] = 1.0
    scores = step([seven], nothing_allowed)  # the grammar allows digits and eos; the other processor none of them
    assert eos in _finite(scores, 0) and seven in _finite(scores, 0) and hello not in _finite(scores, 0)


def test_batch_size_must_match_the_grammars(compilers: GrammarCompilerCache) -> None:
    proc = GrammarLogitsProcessor([compilers.compile("json_object"), None], eos_token_id=2)
    with pytest.raises(ValueError, match="made for 2 rows but generate runs 4"):
        proc(torch.zeros((4, 3), dtype=torch.long), torch.zeros((4, VOCAB)))


# --- real generation ----------------------------------------------------------------------------------------------

PROMPTS = [
    "Which chunk sizes (sentence, paragraph, subsection, section, document) should a retriever read to answer: "
    "Who founded the Norman dynasty? Reply in JSON with level_min and level_max.",
    "What is the capital of France?",
    "Describe a cat as a JSON object with the keys name and age.",
]


def _chat_batch(tokenizer, prompts: list[str]) -> dict:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return tokenizer.pad([tokenizer(t) for t in texts], padding_side="left", return_tensors="pt")


def _replies(tokenizer, output: torch.Tensor, prompt_len: int) -> list[str | None]:
    """Each row's text up to its first eos; None for a row that hit max_new_tokens first."""
    replies = []
    for row in output[:, prompt_len:].tolist():
        ends = [i for i, t in enumerate(row) if t == tokenizer.eos_token_id]
        replies.append(tokenizer.decode(row[: ends[0]]) if ends else None)
    return replies


def _generate(model, batch: dict, processor: GrammarLogitsProcessor | None = None, **kwargs) -> torch.Tensor:
    extra = {"logits_processor": LogitsProcessorList([processor])} if processor is not None else {}
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=64, **extra, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"do_sample": True, "temperature": 0.8}],
                         ids=["greedy", "sampled"])
def test_mixed_batch_schema_free_text_and_json_object(smollm, compilers: GrammarCompilerCache, sampling) -> None:
    model, tokenizer = smollm
    batch = _chat_batch(tokenizer, PROMPTS)
    assert (batch["attention_mask"][:, 0] == 0).any()  # rows really are left padded
    grammars = [compilers.compile(grammar_spec(schema_format(LEVEL_SCHEMA))), None,
                compilers.compile(grammar_spec({"type": "json_object"}))]
    proc = GrammarLogitsProcessor(grammars, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    output = _generate(model, batch, proc, **sampling)
    plan, free, obj = _replies(tokenizer, output, batch["input_ids"].shape[1])
    assert proc.rejected_rows == set()
    jsonschema.validate(json.loads(plan), LEVEL_SCHEMA)  # None (no eos before max_new_tokens) fails here too
    assert isinstance(json.loads(obj), dict)
    if not sampling["do_sample"]:
        alone = _chat_batch(tokenizer, PROMPTS[1:2])
        reference = _replies(tokenizer, _generate(model, alone, do_sample=False), alone["input_ids"].shape[1])
        assert free == reference[0]


@pytest.mark.slow
def test_num_return_sequences_sampling(smollm, compilers: GrammarCompilerCache) -> None:
    model, tokenizer = smollm
    batch = _chat_batch(tokenizer, [PROMPTS[0], PROMPTS[2]])
    level, obj = compilers.compile(LEVEL_SCHEMA), compilers.compile("json_object")
    proc = GrammarLogitsProcessor([level, level, obj, obj], eos_token_id=tokenizer.eos_token_id)  # rows expanded
    torch.manual_seed(1)
    output = _generate(model, batch, proc, do_sample=True, temperature=0.8, num_return_sequences=2)
    replies = _replies(tokenizer, output, batch["input_ids"].shape[1])
    assert output.shape[0] == 4 and proc.rejected_rows == set()
    for reply in replies[:2]:
        jsonschema.validate(json.loads(reply), LEVEL_SCHEMA)
    assert all(isinstance(json.loads(reply), dict) for reply in replies[2:])


# The planner prompts the data pipeline builds for the shipped SQuAD sample: one per answerable single-document
# question (what the pseudo-labels job labels and planner_rows/unlabelled_rows prompt with), 473 of them. All of
# them take 12.5 min here (all 473 validated when this test was written), so by default the suite plans the first
# OVERSTORY_TEST_PLANNER_PROMPTS (24) in the order the pseudo-labels job's `limit` takes them (round robin over the
# documents); "all" runs every one.
PLANNER_PROMPTS = os.environ.get("OVERSTORY_TEST_PLANNER_PROMPTS", "24")
BATCH = 16


def _planner_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of the planner prompts, grouped by document (prompts of one document share a long prefix)."""
    documents, questions = load_corpus("squad", ROOT / "data/squad/dev-v2.0-articles.json")
    pairs = round_robin_by_document(single_document_questions(questions))
    if PLANNER_PROMPTS != "all":
        pairs = pairs[: int(PLANNER_PROMPTS)]
    # eval planner's default view of the document (configs/eval/planner.yaml: metadata_tokens 256)
    metadata = {d.id: document_metadata(d.title, d.text, tokenizer, 256) for d in documents}
    grouped: dict[str, list[list[int]]] = {}
    for question, doc_id in pairs:
        text = tokenizer.apply_chat_template(planner_messages(question.question, metadata[doc_id]), tokenize=False,
                                             add_generation_prompt=True)
        grouped.setdefault(doc_id, []).append(tokenizer(text).input_ids)
    return grouped


def _common_prefix(rows: list[list[int]]) -> int:
    length = min(len(r) for r in rows) - 1  # leave every row at least one token of its own
    for i in range(length):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return length


@pytest.mark.slow
def test_every_planner_prompt_gets_a_valid_plan(smollm, compilers: GrammarCompilerCache) -> None:
    model, tokenizer = smollm
    grammar = compilers.compile(grammar_spec(schema_format(PLAN_SCHEMA)))
    grouped = _planner_prompts(tokenizer)
    replies: list[str | None] = []
    for rows in grouped.values():
        # The system prompt and the document's beginning (~420 tokens) are the same for every question of a
        # document; prefilling them once and reusing the cache makes each prompt cost its ~20 question tokens.
        # Between the shared prefix and each row's question sits padding (mask 0); generate derives positions from
        # the mask, so every row sees itself as unpadded. The processor only sees input_ids, as in any batch.
        shared = _common_prefix(rows)
        prefix_cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([rows[0][:shared]]), past_key_values=prefix_cache)
        for start in range(0, len(rows), BATCH):
            chunk = rows[start: start + BATCH]
            width = max(len(r) for r in chunk) - shared
            ids = torch.full((len(chunk), shared + width), tokenizer.pad_token_id)
            mask = torch.zeros_like(ids)
            for i, row in enumerate(chunk):
                ids[i, :shared], mask[i, :shared] = torch.tensor(row[:shared]), 1
                ids[i, shared + width - (len(row) - shared):] = torch.tensor(row[shared:])
                mask[i, shared + width - (len(row) - shared):] = 1
            cache = copy.deepcopy(prefix_cache)
            cache.batch_repeat_interleave(len(chunk))
            proc = GrammarLogitsProcessor([grammar] * len(chunk), eos_token_id=tokenizer.eos_token_id)
            with torch.no_grad():
                output = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                        max_new_tokens=48, logits_processor=LogitsProcessorList([proc]))
            assert proc.rejected_rows == set()
            replies += _replies(tokenizer, output, ids.shape[1])
    assert len(replies) == (473 if PLANNER_PROMPTS == "all" else int(PLANNER_PROMPTS))
    failed = [r for r in replies if r is None or not strict_plan_valid(r)]
    assert not failed, f"{len(failed)} of {len(replies)} replies are not valid plans, e.g. {failed[:3]}"
    for reply in replies:
        jsonschema.validate(json.loads(reply), PLAN_SCHEMA)
