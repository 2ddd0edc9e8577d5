"""Every field of OpenAI's and vLLM's request schemas takes effect, labels the request, or is refused by name;
a made-up field gets OpenAI's 400. The unit tests need no model; the rest drive the real SmolLM2 and MiniLM
through HTTP, the in-process client and the official ``openai`` client (``extra_body`` included)."""

from __future__ import annotations

import base64
from importlib.metadata import version

import httpx
import numpy as np
import openai
import pytest
import torch
from openai.types import completion_create_params, embedding_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from overstory.serving.batching import RowPenalties, Sampling
from overstory.serving.client import ClientError
from overstory.serving.in_process import in_process_client
from overstory.serving.protocol import ChatRequest, CompletionRequest, EmbeddingRequest, validation_message
from tests.serving.metrics_page import parse, value

# vLLM 0.32.0's request fields (ChatCompletionRequest, CompletionRequest, EmbeddingCompletionRequest and
# EmbeddingChatRequest's model_fields), listed here because vLLM is not importable in the main environment.
VLLM_CHAT = """add_generation_prompt add_special_tokens allowed_token_ids bad_words cache_salt chat_template
chat_template_kwargs continue_final_message documents ec_transfer_params echo frequency_penalty ignore_eos
include_reasoning include_stop_str_in_output kv_transfer_params length_penalty logit_bias logprob_token_ids logprobs
max_completion_tokens max_tokens media_io_kwargs messages min_p min_tokens mm_payload mm_processor_kwargs model n
parallel_tool_calls presence_penalty priority prompt_logprobs reasoning_effort repetition_detection repetition_penalty
request_id response_format return_mm_kwargs return_prompt_text return_token_ids return_token_offsets
return_tokens_as_token_ids routed_experts_prompt_start seed session_id skip_special_tokens
spaces_between_special_tokens stop stop_token_ids stream stream_interval stream_options structured_outputs
temperature thinking_token_budget tool_choice tools top_k top_logprobs top_p truncate_prompt_tokens truncation_side
use_beam_search user vllm_xargs watermarking""".split()
VLLM_COMPLETION = """add_special_tokens allowed_token_ids bad_words cache_salt ec_transfer_params echo
frequency_penalty ignore_eos include_stop_str_in_output kv_transfer_params length_penalty logit_bias
logprob_token_ids logprobs max_tokens min_p min_tokens mm_payload model n presence_penalty priority prompt
prompt_embeds prompt_logprobs repetition_detection repetition_penalty request_id response_format return_mm_kwargs
return_token_ids return_token_offsets return_tokens_as_token_ids routed_experts_prompt_start seed session_id
skip_special_tokens spaces_between_special_tokens stop stop_token_ids stream stream_interval stream_options
structured_outputs suffix temperature thinking_token_budget top_k top_p truncate_prompt_tokens truncation_side
use_beam_search user vllm_xargs watermarking""".split()
VLLM_EMBEDDING = """add_generation_prompt add_special_tokens cache_salt chat_template chat_template_kwargs
continue_final_message dimensions embed_dtype encoding_format endianness input media_io_kwargs messages
mm_processor_kwargs model padding priority request_id truncate_prompt_tokens truncation_side use_activation
user""".split()

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def _errors(model, payload: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(payload)
    return validation_message(caught.value.errors())


@pytest.mark.parametrize("model,openai_fields,vllm_fields", [
    (ChatRequest, chat_create_params.CompletionCreateParamsBase.__annotations__, VLLM_CHAT),
    (CompletionRequest, completion_create_params.CompletionCreateParamsBase.__annotations__, VLLM_COMPLETION),
    (EmbeddingRequest, embedding_create_params.EmbeddingCreateParams.__annotations__, VLLM_EMBEDDING),
])
def test_every_field_of_both_schemas_is_declared(model, openai_fields, vllm_fields) -> None:
    # a field left undeclared would be answered as a made-up name: not wrong, but not the named refusal
    missing = sorted((set(openai_fields) | set(vllm_fields)) - set(model.model_fields))
    assert missing == []


def test_a_made_up_field_is_refused_as_openai_refuses_it() -> None:
    assert _errors(ChatRequest, {"model": "m", "messages": QUESTION, "foo": 1}) == (
        "Unrecognized request argument supplied: foo", "foo")
    message, _ = _errors(EmbeddingRequest, {"model": "m", "input": "x", "foo": 1, "bar": 2})
    assert message == "Unrecognized request arguments supplied: foo, bar"
    nested = {"model": "m", "messages": QUESTION, "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    assert _errors(ChatRequest, nested) == ("Unrecognized request argument supplied: stream_options.x",
                                            "stream_options.x")


@pytest.mark.parametrize("model,payload,field", [
    (CompletionRequest, {"best_of": 2}, "best_of"),
    (CompletionRequest, {"echo": True}, "echo"),
    (CompletionRequest, {"suffix": "end"}, "suffix"),
    (ChatRequest, {"use_beam_search": True}, "use_beam_search"),
    (ChatRequest, {"guided_json": {"type": "object"}}, "guided_json"),
    (ChatRequest, {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    (ChatRequest, {"reasoning_effort": "low"}, "reasoning_effort"),
    (ChatRequest, {"service_tier": "flex"}, "service_tier"),
    (ChatRequest, {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (EmbeddingRequest, {"embed_dtype": "float16"}, "embed_dtype"),
])
def test_an_unsupported_value_is_refused_by_name(model, payload, field) -> None:
    base = {"model": "m", "messages": QUESTION} if model is ChatRequest else {"model": "m"}
    base |= {"prompt": "x"} if model is CompletionRequest else {"input": "x"} if model is EmbeddingRequest else {}
    message, param = _errors(model, base | payload)
    assert param == field and message.startswith(f"{field.split('.')[-1]}=") and "not supported" in message


def test_neutral_values_and_labels_are_accepted() -> None:
    request = CompletionRequest.model_validate({
        "model": "m", "prompt": "x", "best_of": 1, "echo": False, "use_beam_search": False, "ignore_eos": False,
        "skip_special_tokens": True, "user": "u", "request_id": "r", "cache_salt": "s"})
    assert request.user == "u" and request.best_of == 1
    chat = ChatRequest.model_validate({"model": "m", "messages": QUESTION, "metadata": {"team": "a"}, "store": True,
                                       "service_tier": "auto", "safety_identifier": "h", "prompt_cache_key": "k"})
    assert chat.metadata == {"team": "a"} and chat.store is True


def test_sampling_passes_the_new_fields_to_the_engine() -> None:
    request = ChatRequest.model_validate({"model": "m", "messages": QUESTION, "top_k": -1, "min_p": 0.1,
                                          "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                          "repetition_penalty": 1.2, "logit_bias": {"42": -100}})
    sampling = request.sampling()
    assert (sampling["top_k"], sampling["min_p"], sampling["presence_penalty"], sampling["frequency_penalty"],
            sampling["repetition_penalty"], sampling["logit_bias"]) == (0, 0.1, 0.5, -0.5, 1.2, {"42": -100})


def test_row_penalties_follow_openai_and_vllm_definitions() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    # prompt of width 2, then two generated tokens: 3 twice
    input_ids = torch.tensor([[1, 2, 3, 3]])
    sampling = Sampling(max_tokens=4, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((4, 7.0),))
    processor = RowPenalties([(sampling, [1, 2])])
    processor.start = 2
    out = processor(input_ids, logits.clone())
    # token 3 appeared twice: 3.0 - 2 * 0.25 - 0.5; token 4 biased; the prompt's tokens 1, 2 untouched
    assert out.tolist() == [[2.0, -1.0, 0.5, 2.0, 7.0]]
    repeat = RowPenalties([(Sampling(max_tokens=4, repetition_penalty=2.0), [1, 2])])
    repeat.start = 2
    # the prompt's tokens and the generated ones: positive logits halved, negative doubled
    assert repeat(input_ids, logits.clone()).tolist() == [[2.0, -2.0, 0.25, 1.5, 0.0]]
    untouched = RowPenalties([(Sampling(max_tokens=4), [1, 2])])
    assert untouched(input_ids, logits.clone()).tolist() == logits.tolist()


# -- through the server, with the real models ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def http(server_url: str):
    with httpx.Client(base_url=server_url, timeout=300) as client:
        yield client


def _complete(http: httpx.Client, **fields) -> dict:
    response = http.post("/v1/completions", json={"model": "generator", "max_tokens": 8, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _reference_greedy(engine, prompt: str, steps: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding written out with OpenAI's penalty formula, one full forward per step."""
    tokenizer, model = engine.tokenizer("generator"), engine._models["generator"].model
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids + generated])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]).float()
            token = int((logits - counts * frequency - (counts > 0).float() * presence).argmax())
            generated.append(token)
            if token == tokenizer.eos_token_id:
                break
    return generated


@pytest.mark.slow
def test_penalties_change_the_greedy_choice_as_openai_defines_them(http: httpx.Client, engine) -> None:
    prompt, tokenizer = "one one one one one one", engine.tokenizer("generator")
    plain = _complete(http, prompt=prompt, temperature=0)["choices"][0]["text"]
    penalised = _complete(http, prompt=prompt, temperature=0, presence_penalty=2.0,
                          frequency_penalty=2.0)["choices"][0]["text"]
    expected = tokenizer.decode(_reference_greedy(engine, prompt, 8, 2.0, 2.0), skip_special_tokens=True)
    assert penalised == expected and penalised != plain


@pytest.mark.slow
def test_logit_bias_forces_a_token_and_top_k_1_is_greedy(http: httpx.Client, engine) -> None:
    token = engine.tokenizer("generator")(" banana", add_special_tokens=False)["input_ids"][0]
    forced = _complete(http, prompt="The capital of France is", temperature=0.8, seed=1, max_tokens=3,
                       logit_bias={str(token): 100})
    assert forced["choices"][0]["text"] == engine.tokenizer("generator").decode([token] * 3)
    greedy = _complete(http, prompt="The capital of France is", temperature=0)["choices"][0]["text"]
    for seed in (1, 2):
        top1 = _complete(http, prompt="The capital of France is", temperature=1.0, seed=seed, top_k=1)
        assert top1["choices"][0]["text"] == greedy


def _embedder_successes(http: httpx.Client) -> float:
    """The server's ``request_success_total`` for the embedder (finished reason stop), from its /metrics page."""
    return value(parse(http.get("/metrics").text), "overstory:request_success_total", model_name="embedder",
                 finished_reason="stop") or 0.0


@pytest.mark.slow
def test_embeddings_in_base64_and_dimensions(http: httpx.Client) -> None:
    texts = ["a short text", "another one"]
    before = _embedder_successes(http)
    floats = http.post("/v1/embeddings", json={"model": "embedder", "input": texts}).json()["data"]
    encoded = http.post("/v1/embeddings", json={"model": "embedder", "input": texts,
                                                "encoding_format": "base64"}).json()["data"]
    for as_floats, as_base64 in zip(floats, encoded):
        vector = np.frombuffer(base64.b64decode(as_base64["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(vector, np.asarray(as_floats["embedding"], dtype=np.float32))
    big = http.post("/v1/embeddings", json={"model": "embedder", "input": texts[0], "encoding_format": "base64",
                                            "endianness": "big"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(big), dtype=">f4"), floats[0]["embedding"])
    native = len(floats[0]["embedding"])
    same = http.post("/v1/embeddings", json={"model": "embedder", "input": texts, "dimensions": native})
    assert same.status_code == 200 and same.json()["data"][0]["embedding"] == floats[0]["embedding"]
    cut = http.post("/v1/embeddings", json={"model": "embedder", "input": texts, "dimensions": 64})
    assert cut.status_code == 400 and cut.json()["error"]["param"] == "dimensions"
    # one engine request per input finished, as vLLM counts pooling requests; the refused request counts none
    assert _embedder_successes(http) - before == 2 + 2 + 1 + 2


@pytest.mark.slow
@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"model": "generator", "messages": QUESTION, "foo": 1}, "foo"),
    ("/v1/completions", {"model": "generator", "prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/embeddings", {"model": "embedder", "input": "x", "messages": QUESTION}, "messages"),
    ("/tokenize", {"prompt": "x", "bogus": True}, "bogus"),
    ("/score", {"model": "scorer", "queries": "q", "documents": ["d"], "foo": 1}, "foo"),
    ("/v1/rerank", {"model": "scorer", "query": "q", "documents": ["d"], "instruction": "Judge."}, "instruction"),
])
def test_refusals_over_http_and_in_process(http: httpx.Client, engine, path, body, field) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(ClientError) as caught:
        in_process_client(engine).backend.post(path, body)
    assert caught.value.status == 400 and caught.value.reason == error["message"]


@pytest.mark.slow
def test_labels_are_accepted(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={
        "model": "generator", "messages": QUESTION, "max_tokens": 2, "temperature": 0, "user": "u-1",
        "metadata": {"job": "test"}, "store": False, "request_id": "abc", "session_id": "s"})
    assert response.status_code == 200, response.text


@pytest.mark.slow
def test_tokenize_round_trips_through_detokenize(http: httpx.Client, engine) -> None:
    text = "Hierarchical retrieval, tokenized."
    tokens = http.post("/tokenize", json={"model": "generator", "prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert tokens["max_model_len"] == engine.max_model_len("generator")
    assert http.post("/detokenize", json={"model": "generator", "tokens": tokens["tokens"]}).json() == {
        "prompt": text}
    # messages are counted as the chat endpoint counts its prompt; model may be left out (the first chat role)
    chat = http.post("/tokenize", json={"messages": QUESTION}).json()
    usage = http.post("/v1/chat/completions", json={"model": "generator", "messages": QUESTION, "max_tokens": 1,
                                                     "temperature": 0}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert http.post("/tokenize", json={"model": "embedder", "prompt": "x"}).status_code == 400


@pytest.mark.slow
def test_version_and_models(http: httpx.Client, engine) -> None:
    assert http.get("/version").json() == {"version": version("overstory")}
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert all(isinstance(m["created"], int) and m["created"] > 0 for m in models.values())
    assert models["generator"]["max_model_len"] == engine.max_model_len("generator") > 0
    assert models["embedder"]["max_model_len"] == engine._models["embedder"].encoder.max_seq_length
    # the precision of the weights behind each role, which a record names beside the model (vLLM lists no dtype)
    assert {role: m["dtype"] for role, m in models.items()} == {
        role: engine.config.roles[role].dtype for role in engine.roles} and models["generator"]["dtype"] == "float32"


@pytest.mark.slow
def test_the_official_client_and_extra_body(server_url: str) -> None:
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="generator", messages=QUESTION, max_tokens=2,
                                       extra_body={"not_a_field": 1})
    assert caught.value.status_code == 400 and "Unrecognized request argument supplied: not_a_field" in str(
        caught.value)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model="generator", prompt="x", max_tokens=2, best_of=2)
    greedy = client.completions.create(model="generator", prompt="The capital of France is", max_tokens=8,
                                       temperature=0).choices[0].text
    top1 = client.completions.create(model="generator", prompt="The capital of France is", max_tokens=8,
                                     temperature=1.0, seed=3, extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy
    vectors = client.embeddings.create(model="embedder", input=["one text"])  # the client asks for base64
    floats = client.embeddings.create(model="embedder", input=["one text"], encoding_format="float")
    np.testing.assert_allclose(vectors.data[0].embedding, floats.data[0].embedding, rtol=0, atol=0)
    assert all(model.created > 0 for model in client.models.list().data)
