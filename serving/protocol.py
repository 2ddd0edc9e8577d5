"""The embedded server's request models: every field of OpenAI's and vLLM's request schemas (chat completions,
completions, embeddings) takes effect, labels the request, or is refused with a 400 that names it.

The models forbid extra fields (pydantic's ``extra="forbid"``), so a name in neither schema is answered as
OpenAI answers it: 400, ``Unrecognized request argument supplied: <name>``. A field of either schema that the
embedded engine cannot honour is declared with ``refused(reason, *neutral)``: a value that changes nothing
(None, or one of ``neutral``, such as ``best_of=1`` or ``use_beam_search=false``) is accepted, any other is
refused by name, never ignored. Fields that only label a request (``user``, ``metadata``, ``store``,
``request_id``, ...) are declared with ``label()`` and accepted. Schemas followed: OpenAI's (the ``openai``
package's ``*CreateParams``) and vLLM 0.32's ``chat_completion/protocol.py``, ``completion/protocol.py`` and
``pooling/embed/protocol.py``; vLLM's removed ``guided_*`` fields are refused with a pointer to
``response_format``. Stream options are checked the same way; messages and tools keep lenient models, so
that a client's round-tripped assistant message (with its null ``refusal``, ``audio``, ...) still parses.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED = "unsupported_field"  # the validation error type of a refused field


def _valid_text(text: str) -> str:
    """Text the tokenizer can take: a lone surrogate (valid JSON escape, invalid Unicode) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode ({exc.reason} at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_valid_text)]


def refused(reason: str, *neutral: Any) -> Any:
    """A field the embedded engine cannot honour: None and the ``neutral`` values (which change nothing) pass,
    any other value is refused with ``reason``. The marks live in the field's JSON schema, so ``/docs`` shows
    them too."""
    return Field(default=None, json_schema_extra={"refused": reason, "neutral": list(neutral)})


def label() -> Any:
    """A field that only labels a request (who sent it, how to file it): accepted, no effect on the answer."""
    return Field(default=None, json_schema_extra={"label": True})


class StrictRequest(BaseModel):
    """A request model that refuses unknown fields and the non-neutral values of its ``refused`` fields."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> StrictRequest:
        for name, field in type(self).model_fields.items():
            marks = field.json_schema_extra
            if not isinstance(marks, dict) or "refused" not in marks:
                continue
            value = getattr(self, name)
            if value is not None and value not in marks["neutral"]:
                raise PydanticCustomError(UNSUPPORTED, "{param}={value} is not supported by the embedded engine: "
                                          "{reason}", {"param": name, "value": repr(value), "reason": marks["refused"]})
        return self


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The 400's message and ``param`` for pydantic's validation ``errors``: OpenAI's wording for unknown
    fields (all of them named), the refusal of an unsupported field, or the first error with its field path."""
    unknown = [".".join(str(p) for p in e["loc"] if p != "body") for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        return f"Unrecognized request argument{plural} supplied: {', '.join(unknown)}", unknown[0]
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if first.get("type") == UNSUPPORTED:  # located at the model holding the field: stream_options, or the body
        return first["msg"], ".".join(filter(None, (where, first["ctx"]["param"])))
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    return f"{where or 'body'}: {first.get('msg', 'invalid request')}", where or None


class ContentPart(BaseModel):
    """One part of a message's content as OpenAI clients send it; only text parts can be read here."""

    type: str
    text: Text | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system"
        message = self.model_dump(exclude_none=True)
        if self.role == "developer":
            message["role"] = "system"
        return message


class StreamOptions(StrictRequest):
    include_usage: bool = False
    include_obfuscation: Any = refused("no obfuscation padding is added to streamed chunks", False)
    continuous_usage_stats: Any = refused("usage comes once, in the last chunk (include_usage)", False)


NOT_BATCHED = "not available with batched transformers generation"


class _Labels(StrictRequest):
    """Fields of both schemas that only label a request (or hint at a cache this engine does not keep)."""

    user: str | None = label()
    request_id: str | None = label()  # vLLM's; the embedded server makes its own response ids
    session_id: str | None = label()
    cache_salt: str | None = label()  # salts vLLM's prefix cache; nothing is cached across requests here
    priority: Any = refused("the embedded engine schedules requests first come, first served", 0)
    vllm_xargs: Any = refused("no custom extensions are installed")
    kv_transfer_params: Any = refused("no disaggregated serving")
    ec_transfer_params: Any = refused("no disaggregated serving")
    mm_processor_kwargs: Any = refused("text-only models", {})
    truncate_prompt_tokens: Any = refused("prompts are never truncated; a prompt over the context gets a 400")
    truncation_side: Any = refused("prompts are never truncated")


class SamplingRequest(_Labels):
    """What chat and completion requests share: sampling, penalties, stop strings, streaming."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's; None, 0 and -1 leave it off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> bias
    n: int = Field(default=1, ge=1, le=16)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's sampling extras
    use_beam_search: Any = refused("no beam search; sample or decode greedily", False)
    length_penalty: Any = refused("only meaningful for beam search", 1.0)
    stop_token_ids: Any = refused("stop on strings (stop) instead", [])
    include_stop_str_in_output: Any = refused("stop strings are left out, as OpenAI does", False)
    ignore_eos: Any = refused("generation always ends at the end-of-sequence token", False)
    min_tokens: Any = refused(NOT_BATCHED, 0)
    skip_special_tokens: Any = refused("special tokens are always skipped in the text", True)
    spaces_between_special_tokens: Any = refused("special tokens are always skipped in the text", True)
    prompt_logprobs: Any = refused("no prompt log-probabilities")
    logprob_token_ids: Any = refused("log-probabilities come as the top alternatives (logprobs)")
    allowed_token_ids: Any = refused("constrain the reply with response_format, or use logit_bias")
    bad_words: Any = refused("use logit_bias with a negative bias", [])
    watermarking: Any = refused("no watermarking", False)
    structured_outputs: Any = refused("use response_format (json_schema, json_object)")
    return_tokens_as_token_ids: Any = refused("tokens come as text", False)
    return_token_ids: Any = refused("token ids are not returned", False)
    routed_experts_prompt_start: Any = refused("no mixture-of-experts routing data", 0)
    return_token_offsets: Any = refused("token offsets come only from /tokenize", False)
    repetition_detection: Any = refused("generation ends at max_tokens, a stop string or end of sequence")
    stream_interval: Any = refused("every decoded piece of text is streamed as it comes", 1)
    thinking_token_budget: Any = refused("no reasoning parser")
    mm_payload: Any = refused("text-only models", "tensors")
    return_mm_kwargs: Any = refused("text-only models")
    # vLLM's guided decoding fields, removed in vLLM 0.12 (ignored there with a warning): refused here
    guided_json: Any = refused("use response_format with a json_schema")
    guided_regex: Any = refused("use response_format with a json_schema")
    guided_choice: Any = refused("use response_format with a json_schema (an enum)")
    guided_grammar: Any = refused("use response_format with a json_schema")
    guided_decoding_backend: Any = refused("the grammar backend is xgrammar")
    guided_whitespace_pattern: Any = refused("use response_format")

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling keyword arguments."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k if self.top_k and self.top_k > 0 else 0, "min_p": self.min_p or 0.0,
                "presence_penalty": self.presence_penalty or 0.0, "frequency_penalty": self.frequency_penalty or 0.0,
                "repetition_penalty": self.repetition_penalty or 1.0, "logit_bias": self.logit_bias or {},
                "n": self.n, "stop": stop, "seed": self.seed}


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # every call in the reply is returned either way
    # OpenAI's labels and cache hints
    metadata: dict[str, str] | None = label()
    store: bool | None = label()
    safety_identifier: str | None = label()
    prompt_cache_key: str | None = label()
    prompt_cache_retention: str | None = label()  # nothing is cached across requests here
    prompt_cache_options: dict[str, Any] | None = label()
    # OpenAI's fields the embedded engine cannot honour
    service_tier: Any = refused("the embedded server has one tier", "auto", "default")
    modalities: Any = refused("text replies only", ["text"])
    audio: Any = refused("text replies only")
    prediction: Any = refused("no predicted outputs")
    reasoning_effort: Any = refused("the served models do not reason before answering")
    verbosity: Any = refused("no verbosity control")
    web_search_options: Any = refused("no web search")
    moderation: Any = refused("no moderation")
    functions: Any = refused("the deprecated functions API: send tools")
    function_call: Any = refused("the deprecated functions API: send tool_choice")
    # vLLM's chat extras
    include_reasoning: Any = refused("no reasoning parser", True)
    echo: Any = refused("the reply is not prefixed with the last message", False)
    add_generation_prompt: Any = refused("the chat template's generation prompt is always added", True)
    continue_final_message: Any = refused("the reply always starts a new assistant message", False)
    add_special_tokens: Any = refused("the chat template adds the special tokens", False)
    documents: Any = refused("put the documents in the messages")
    chat_template: Any = refused("the model's own chat template is used")
    chat_template_kwargs: Any = refused("the model's own chat template is used with its defaults", {})
    media_io_kwargs: Any = refused("text-only models", {})
    return_prompt_text: Any = refused("the rendered prompt is not returned", False)

    def tools_offered(self) -> list[dict[str, Any]] | None:
        return self.tools if self.tools and self.tool_choice != "none" else None


class CompletionRequest(SamplingRequest):
    # a string, strings, token ids or lists of token ids; a list runs as one batch, choices come prompt by prompt
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy API: k alternatives per token
    echo: Any = refused("the prompt is not echoed; send echo=false", False)
    best_of: Any = refused("each of the n choices is returned; send n instead", 1)
    suffix: Any = refused("no fill-in-the-middle")
    prompt_embeds: Any = refused("prompts are text or token ids")
    add_special_tokens: Any = refused("text prompts are tokenized without special tokens", False)


class EmbeddingRequest(_Labels):
    model: str
    input: Text | list[Text]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)  # only the model's own dimension; see handle_embeddings
    endianness: Literal["native", "little", "big"] = "native"  # vLLM's, for base64
    embed_dtype: Any = refused("embeddings are float32", "float32")
    # -1 is vLLM's "truncate to the model's maximum", which sentence-transformers always does
    truncate_prompt_tokens: Any = refused("texts are truncated to the encoder's max_seq_length", -1)
    truncation_side: Any = refused("texts are truncated on the right", "right")
    use_activation: Any = refused("embeddings are always L2-normalised", True)
    padding: Any = refused("texts are padded per batch by sentence-transformers")
    add_special_tokens: Any = refused("the encoder's tokenizer adds its special tokens", True)
    # vLLM's chat-style embedding request
    messages: Any = refused("send the texts as input")
    add_generation_prompt: Any = refused("send the texts as input")
    continue_final_message: Any = refused("send the texts as input")
    chat_template: Any = refused("send the texts as input")
    chat_template_kwargs: Any = refused("send the texts as input")
    media_io_kwargs: Any = refused("text-only models")


class CompressRequest(StrictRequest):
    """Groups of child chunks: ``input`` as texts, or ``embeddings`` as vectors (one of the two)."""

    model: str
    input: list[list[str]] | None = None
    embeddings: list[list[list[float]]] | None = None
    user: str | None = label()


class TokenizeRequest(StrictRequest):
    """vLLM's ``/tokenize``: a ``prompt`` (completion form) or chat ``messages`` (rendered with the chat
    template, ``tools`` included); ``model`` names a chat role (the first one when left out)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: Any = refused("the chat template's generation prompt is always added", True)
    continue_final_message: Any = refused("the chat is rendered for a new assistant message", False)
    return_token_strs: bool = False
    chat_template: Any = refused("the model's own chat template is used")
    chat_template_kwargs: Any = refused("the model's own chat template is used with its defaults", {})
    media_io_kwargs: Any = refused("text-only models", {})
    mm_processor_kwargs: Any = refused("text-only models", {})

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(StrictRequest):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
