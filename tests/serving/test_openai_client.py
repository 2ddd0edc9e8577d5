"""The embedded server driven by the official ``openai`` package, as other people's code drives it: chat,
streaming, tool calls, structured outputs, completions, embeddings, the model list and error types, with the
real SmolLM2 and MiniLM."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from overstory.models.planner import TRACE_SCHEMA

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "keyword_search", "description": "Search the corpus for keywords.",
    # bounds a careful tool author sets: a 135M model under a grammar can otherwise write one keyword forever
    "parameters": {"type": "object", "properties": {"keywords": {
        "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3}},
        "required": ["keywords"]}}}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_chat_and_usage(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["generator", "planner", "scorer", "embedder"]
    reply = client.chat.completions.create(model="generator", messages=QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_equals_the_unstreamed_reply(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="generator", messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="generator", messages=QUESTION, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) > 3  # streamed piece by piece, not in one chunk


def test_streamed_completion_and_token_id_prompts(client: openai.OpenAI, engine) -> None:
    whole = client.completions.create(model="generator", prompt="One, two, three,", max_tokens=8, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="generator", prompt="One, two, three,", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    ids = engine.tokenizer("generator")("One, two, three,", add_special_tokens=False)["input_ids"]
    by_ids = client.completions.create(model="generator", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_replies_validate(client: openai.OpenAI, temperature: float) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "plan", "schema": TRACE_SCHEMA}}
    for question in ("When was the Eiffel Tower built?", "Why did the Roman Empire fall?"):
        reply = client.chat.completions.create(
            model="planner", messages=[{"role": "user", "content": f"Plan the chunk sizes for: {question}"}],
            max_tokens=200, temperature=temperature, seed=0, response_format=response_format)
        jsonschema.validate(json.loads(reply.choices[0].message.content), TRACE_SCHEMA)


def test_json_object_reply_parses(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="generator", messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        max_tokens=48, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "keyword_search"}}])
def test_forced_tool_calls_are_well_formed(client: openai.OpenAI, tool_choice) -> None:
    reply = client.chat.completions.create(
        model="generator", messages=[{"role": "user", "content": "Who founded the city of Rome?"}],
        tools=[WEATHER, SEARCH], tool_choice=tool_choice, max_tokens=96, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("get_weather", "keyword_search")
    if isinstance(tool_choice, dict):
        assert call.function.name == "keyword_search"
    arguments = json.loads(call.function.arguments)
    schema = (WEATHER if call.function.name == "get_weather" else SEARCH)["function"]["parameters"]
    jsonschema.validate(arguments, schema)


def test_tool_round_trip_and_streamed_tool_call(client: openai.OpenAI) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="generator", messages=messages, tools=[WEATHER],
                                           tool_choice=forced, max_tokens=48, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model="generator", messages=history, tools=[WEATHER], tool_choice="auto",
                                            max_tokens=48, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(model="generator", messages=messages, tools=[WEATHER],
                                                 tool_choice=forced, max_tokens=48, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="generator", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                           max_tokens=16, temperature=0)
    assert reply.choices[0].message.tool_calls is None and "Paris" in reply.choices[0].message.content


def test_embeddings(client: openai.OpenAI) -> None:
    data = client.embeddings.create(model="embedder", input=["a cat", "a dog"]).data
    assert [d.index for d in data] == [0, 1] and len(data[0].embedding) == 384


def test_error_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="generator", messages=QUESTION, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="generator", messages=QUESTION, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="generator", prompt="word " * 9000, max_tokens=8)
