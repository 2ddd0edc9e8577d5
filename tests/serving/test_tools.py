"""Tool calling helpers (serving/tools.py): validation, prompts on the real SmolLM2 tokenizer and on handwritten
templates that do render tools, the forced-call schemas, and tolerant reply parsing."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from overstory.models.registry import SMOLLM2, load_tokenizer
from overstory.serving.errors import BadRequest
from overstory.serving.tools import (
    ParsedReply,
    parse_reply,
    render_chat_prompt,
    template_support,
    tool_call_schema,
    validate_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

# Handwritten templates (transformers renders with trim_blocks, so newlines are written as expressions).
# One renders tools, assistant tool_calls (arguments as objects) and tool results itself.
TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'tool' %}[result of {{ m.name }}] {% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Renders tools, but neither tool_calls nor tool results: those fall back to text.
TOOLS_ONLY_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m.role) }}{% endif %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SMOLLM2)  # the tokenizer alone: no model weights needed to render prompts


def with_template(tokenizer, template: str):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def bad_request(param: str, call, *args) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        call(*args)
    assert info.value.param == param, str(info.value)
    return info.value


# ---------------------------------------------------------------------------------------------- validate_tools


def test_valid_tools_and_choices_pass() -> None:
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "get_time"}}):
        validate_tools(TOOLS, choice)
    for choice in (None, "auto", "none"):
        validate_tools(None, choice)
        validate_tools([], choice)


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ("get_weather", None, "tools"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0].type"),
    ([WEATHER, "get_time"], None, "tools[1].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([WEATHER, CLOCK, WEATHER], None, "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}], None,
     "tools[0].function.parameters"),
    (TOOLS, {"type": "function", "function": {"name": "get_stock"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name"),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, 1, "tool_choice"),
])
def test_invalid_tools_name_the_param(tools, choice, param: str) -> None:
    bad_request(param, validate_tools, tools, choice)


# ------------------------------------------------------------------------------------------------- rendering


def test_smollm2_template_renders_no_tool_fields(tokenizer) -> None:
    """Measured: SmolLM2's template prints only role and content, so everything tool-related is ours to write."""
    plain = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(plain, tools=TOOLS, add_generation_prompt=True, tokenize=False) == \
        tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    raw = tokenizer.apply_chat_template([plain[0], {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                                        add_generation_prompt=True, tokenize=False)
    assert "get_weather" not in raw  # the call is dropped: an empty assistant turn
    assert "<|im_start|>assistant\n<|im_end|>" in raw and "<|im_start|>tool\nsunny" in raw  # an untrained role
    support = template_support(tokenizer)
    assert (support.tools, support.tool_calls, support.tool_results) == (False, False, False)


def test_smollm2_prompt_offers_tools_and_the_call_syntax(tokenizer) -> None:
    prompt = render_chat_prompt(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], TOOLS, "auto")
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "named SmolLM" not in system  # ours replaces the default
    assert "<tools>\n" in system and "\n</tools>" in system
    for tool in TOOLS:
        assert json.dumps(tool["function"]) in system  # each signature, as JSON
    assert '<tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}</tool_call>' in system
    assert prompt.count("<|im_start|>system") == 1
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_a_given_system_message_is_kept_and_merged(tokenizer) -> None:
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Weather?"}]
    prompt = render_chat_prompt(tokenizer, messages, [WEATHER], None)  # no tool_choice with tools means auto
    assert prompt.startswith("<|im_start|>system\nAnswer in French.\n\nYou can call functions")
    assert prompt.count("<|im_start|>system") == 1 and '"name": "get_weather"' in prompt


def test_history_with_a_call_and_its_result_renders_both(tokenizer) -> None:
    prompt = render_chat_prompt(tokenizer, HISTORY, TOOLS, "auto")
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt
    assert "<|im_start|>tool" not in prompt


def test_parallel_results_share_one_user_turn_and_text_precedes_calls(tokenizer) -> None:
    second = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [HISTORY[0], {"role": "assistant", "content": "Checking.", "tool_calls": [CALL, second]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    prompt = render_chat_prompt(tokenizer, messages, TOOLS, "auto")
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call><|im_end|>') in prompt
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"
            "<|im_end|>") in prompt


def test_tool_choice_none_leaves_the_tools_out(tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    none = render_chat_prompt(tokenizer, messages, TOOLS, "none")
    assert none == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "get_weather" not in none and "<tool_call>" not in none
    # ... but the history's calls and results are still rendered
    assert "<tool_response>\nsunny, 21 C" in render_chat_prompt(tokenizer, HISTORY, TOOLS, "none")


def test_forced_choices_still_offer_the_tools(tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert "<tools>" in render_chat_prompt(tokenizer, messages, TOOLS, choice)


def test_list_of_text_parts_is_joined(tokenizer) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather in"},
                                            {"type": "text", "text": "Oslo?"}]}]
    assert "<|im_start|>user\nWeather in\nOslo?<|im_end|>" in render_chat_prompt(tokenizer, messages, None, None)
    image = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]
    assert "image_url" in str(bad_request("messages[0].content", render_chat_prompt, tokenizer, image, None, None))


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
     "messages[1].tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "x"}, *HISTORY[:2]], "messages[0].tool_call_id"),
    ([HISTORY[0], {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
    ([{"role": "function", "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([], "messages"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "assistant", "content": None}], "messages[0].content"),
    ([HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {}}]}],
     "messages[1].tool_calls[0]"),
    ([HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_messages_name_the_param(tokenizer, messages, param: str) -> None:
    bad_request(param, render_chat_prompt, tokenizer, messages, TOOLS, "auto")


def test_bad_tools_are_refused_when_rendering(tokenizer) -> None:
    bad_request("tools[1].function.name", render_chat_prompt, tokenizer, HISTORY, [WEATHER, WEATHER], "auto")


def test_a_template_that_renders_tools_is_used_as_is(tokenizer) -> None:
    native = with_template(tokenizer, TOOL_TEMPLATE)
    support = template_support(native)
    assert (support.tools, support.tool_calls, support.tool_results) == (True, True, True)
    prompt = render_chat_prompt(native, [{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS, "auto")
    assert prompt == ("<|tools|> get_weather get_time\n<|system|>Be brief.\n<|user|>Weather in Paris?\n"
                      '<|assistant|>[call get_weather {"city": "Paris"}]\n'  # arguments handed over as an object
                      "<|tool|>[result of get_weather] sunny, 21 C\n<|assistant|>")
    none = render_chat_prompt(native, HISTORY[:1], TOOLS, "none")
    assert none == "<|user|>Weather in Paris?\n<|assistant|>"


def test_what_a_template_lacks_falls_back_to_text(tokenizer) -> None:
    partial = with_template(tokenizer, TOOLS_ONLY_TEMPLATE)
    support = template_support(partial)  # the tool-role probe raises inside the template: counted as not rendered
    assert (support.tools, support.tool_calls, support.tool_results) == (True, False, False)
    prompt = render_chat_prompt(partial, HISTORY, TOOLS, "auto")
    assert prompt == ("<|tools|> get_weather get_time\n<|user|>Weather in Paris?\n"
                      '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                      "<|user|><tool_response>\nsunny, 21 C\n</tool_response>\n<|assistant|>")


def test_a_template_refusing_the_messages_is_a_bad_request(tokenizer) -> None:
    strict = with_template(tokenizer, "{% for m in messages %}{% if m.role == 'system' %}"
                                      "{{ raise_exception('no system role') }}{% endif %}{{ m.content }}{% endfor %}")
    error = bad_request("messages", render_chat_prompt, strict, [{"role": "system", "content": "x"}], None, None)
    assert "no system role" in str(error)


# -------------------------------------------------------------------------------------------- tool_call_schema


def test_named_choice_schema_pins_the_name_and_the_arguments() -> None:
    schema = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert schema == {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                       "arguments": WEATHER["function"]["parameters"]},
                      "required": ["name", "arguments"], "additionalProperties": False}
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not validator.is_valid({"name": "get_time", "arguments": {}})
    assert not validator.is_valid({"name": "get_weather", "arguments": {}})  # city is required
    assert not validator.is_valid({"name": "get_weather", "arguments": {"city": "Paris"}, "note": "x"})


def test_required_schema_accepts_any_tool() -> None:
    schema = tool_call_schema(TOOLS, "required")
    assert len(schema["anyOf"]) == 2
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object"}  # get_time has no parameters
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"name": "get_time", "arguments": {}})
    assert validator.is_valid({"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert not validator.is_valid({"name": "get_stock", "arguments": {}})
    assert not validator.is_valid({"name": "get_time", "arguments": []})
    assert not validator.is_valid({"name": "get_time"})


def test_no_schema_unless_a_call_is_forced() -> None:
    assert tool_call_schema(TOOLS, "auto") is None
    assert tool_call_schema(TOOLS, "none") is None
    assert tool_call_schema(TOOLS, None) is None


def test_refs_in_parameters_still_resolve() -> None:
    """pydantic writes nested models as "#/$defs/..." refs, which must not resolve against the wrapper's root."""
    pet = {"type": "function", "function": {"name": "add_pet", "parameters": {
        "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}}, "required": ["pet"],
        "$defs": {"Pet": {"type": "object", "properties": {"legs": {"type": "integer"}}, "required": ["legs"]}}}}}
    validate_tools([pet, CLOCK], "required")
    for choice in ("required", {"type": "function", "function": {"name": "add_pet"}}):
        validator = jsonschema.Draft202012Validator(tool_call_schema([pet, CLOCK], choice))
        assert validator.is_valid({"name": "add_pet", "arguments": {"pet": {"legs": 4}}})
        assert not validator.is_valid({"name": "add_pet", "arguments": {"pet": {"legs": "four"}}})
    assert pet["function"]["parameters"]["properties"]["pet"] == {"$ref": "#/$defs/Pet"}  # the request is untouched


def test_the_schemas_compile_with_xgrammar() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    pet = {"type": "function", "function": {"name": "add_pet", "parameters": {
        "type": "object", "properties": {"pet": {"$ref": "#/$defs/Pet"}},
        "$defs": {"Pet": {"type": "object", "properties": {"legs": {"type": "integer"}}}}}}}
    for choice in ("required", {"type": "function", "function": {"name": "add_pet"}}):
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(tool_call_schema([pet, *TOOLS], choice)))
        assert "add_pet" in str(grammar)


# -------------------------------------------------------------------------------------------------- parse_reply


def call_of(reply: ParsedReply, i: int = 0) -> tuple[str, dict]:
    call = reply.tool_calls[i]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10
    assert isinstance(call["function"]["arguments"], str)
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_a_well_formed_call() -> None:
    reply = parse_reply('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                        TOOLS, False)
    assert reply.content is None and reply.malformed == 0 and len(reply.tool_calls) == 1
    assert call_of(reply) == ("get_weather", {"city": "Paris"})
    assert reply.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'


def test_multiple_calls_and_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nOne moment.')
    reply = parse_reply(text, TOOLS, False)
    assert reply.content == "Let me check.\nOne moment." and reply.malformed == 0
    assert [call_of(reply, i) for i in range(2)] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert reply.tool_calls[0]["id"] != reply.tool_calls[1]["id"]


def test_an_unclosed_final_block_counts() -> None:
    reply = parse_reply('<tool_call>{"name": "get_time", "arguments": {}}\n', TOOLS, False)
    assert call_of(reply) == ("get_time", {}) and reply.content is None and reply.malformed == 0
    # cut short by the next opening tag
    reply = parse_reply('<tool_call>{"name": "get_time", "arguments": {}}<tool_call>{"name": "get_weather", '
                        '"arguments": {"city": "Rome"}}</tool_call>', TOOLS, False)
    assert [call_of(reply, i)[0] for i in range(2)] == ["get_time", "get_weather"]


def test_a_truncated_block_stays_in_content() -> None:
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"ci'
    assert parse_reply(text, TOOLS, False) == ParsedReply(text, [], 1)


@pytest.mark.parametrize("body", [
    "{name: get_time}",  # not JSON
    '{"name": "get_stock", "arguments": {}}',  # not one of the tools
    '{"name": ["get_time"], "arguments": {}}',  # a name that is not a string
    '{"name": "get_time"}',  # no arguments
    '{"name": "get_time", "arguments": [1]}',  # arguments not an object
    '{"name": "get_time", "arguments": "not json"}',
    '{"name": "get_time", "arguments": {"x": NaN}}',  # Python's json would take it, JSON does not
    '["get_time", {}]',
    "[" * 100000 + "]" * 100000,  # deep enough to overflow the JSON parser's recursion
    "",
])
def test_a_bad_block_stays_in_content(body: str) -> None:
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reply = parse_reply(f"{good}\n<tool_call>{body}</tool_call>", TOOLS, False)
    assert reply.malformed == 1 and call_of(reply) == ("get_time", {})
    assert reply.content == f"<tool_call>{body}</tool_call>"


def test_arguments_as_a_json_string_and_a_fenced_block() -> None:
    reply = parse_reply('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
                        TOOLS, False)
    assert call_of(reply) == ("get_weather", {"city": "Oslo"})
    assert reply.tool_calls[0]["function"]["arguments"] == '{"city": "Oslo"}'  # re-serialised, not passed through
    fenced = parse_reply('<tool_call>\n```json\n{"name": "get_time", "arguments": {}}\n```\n</tool_call>', TOOLS, False)
    assert call_of(fenced) == ("get_time", {})


def test_text_without_calls_comes_back_verbatim() -> None:
    assert parse_reply("  It is sunny.\n", TOOLS, False) == ParsedReply("  It is sunny.\n", [], 0)
    assert parse_reply("", TOOLS, False) == ParsedReply(None, [], 0)
    assert parse_reply('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [], False).malformed == 1


def test_forced_replies() -> None:
    reply = parse_reply(' {"name": "get_weather", "arguments": {"city": "Lima"}}', TOOLS, True)
    assert reply.content is None and reply.malformed == 0 and call_of(reply) == ("get_weather", {"city": "Lima"})
    for junk in ('{"name": "get_weather", "arguments": {"city": "Li', '{"name": "get_stock", "arguments": {}}',
                 "I cannot call tools.", '{"name": "get_time", "arguments": {}} and more'):
        assert parse_reply(junk, TOOLS, True) == ParsedReply(junk, [], 1)
    assert parse_reply("", TOOLS, True) == ParsedReply(None, [], 1)


@pytest.mark.slow
def test_smollm2_reply_to_a_tool_prompt_parses(smollm2: tuple) -> None:
    import torch

    model, tokenizer = smollm2  # the package's copy (conftest.py)
    prompt = render_chat_prompt(tokenizer, [{"role": "user", "content": "What is the weather in Paris?"}],
                                [WEATHER], "auto")
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    reply = parse_reply(text, [WEATHER], False)
    # greedy SmolLM2-135M answers this prompt in prose ("The weather in Paris is a mix of ..."), not with a call:
    # under tool_choice auto the parser must keep such a reply whole as content, with nothing counted malformed
    assert text.startswith("The weather in Paris")
    assert reply == ParsedReply(text, [], 0)
