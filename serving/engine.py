"""The embedded engine: transformers models behind the served roles, on CPU by default.

Generation is transformers' own ``model.generate``, batched across concurrent requests by
``serving.batching`` (one worker per chat model merges compatible requests into left-padded calls);
chat prompts go through the model's own chat template (``serving.tools`` adds the tools where the template
ignores them), and ``response_format`` or a forced tool call constrains decoding with an xgrammar grammar
(``serving.structured``). Roles naming the same model share one copy in memory and one batcher.
``start_chat`` / ``start_completion`` return a ``PendingGeneration`` at once (streaming reads its deltas,
a disconnected client cancels it); ``chat`` / ``complete`` wait for the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from overstory.core.config import ConfigError
from overstory.models.registry import load_causal_lm, load_sentence_encoder, resolve, resolve_device
from overstory.models.text_compressor import checkpoint_kind, join_children, load_text_compressor
from overstory.serving.batching import Batcher, Job, RowOutput, Sampling
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.cross_encoder import CrossEncoderModel
from overstory.serving.embedding_cache import shared_cache
from overstory.serving.errors import BadRequest, RequestTooLarge, UnknownModel
from overstory.serving.model_thread import ModelThread, limit_malloc_arenas
from overstory.serving.structured import GrammarCompilerCache, GrammarLogitsProcessor, grammar_spec
from overstory.serving.tools import render_chat_prompt, tool_call_schema

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability under the model's raw distribution (before
    temperature and top-p, as vLLM reports by default) and the ``top`` most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length" (max_tokens reached)
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per completion token, when the request asked for them


@dataclass(frozen=True)
class GenerationResult:
    choices: list[Completion]  # n per prompt, prompt by prompt (OpenAI's order for a list of prompts)
    prompt_tokens: int
    time_to_first_token_s: float | None = None  # from queueing to the first generated token

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


class PendingGeneration:
    """A queued generation: ``result()`` waits for it, ``cancel()`` stops it (the client went away)."""

    def __init__(self, job: Job, tokenizer, prompt_tokens: int):
        self.job, self.tokenizer, self.prompt_tokens = job, tokenizer, prompt_tokens

    def cancel(self) -> None:
        self.job.cancel()

    def result(self) -> GenerationResult:
        rows = self.job.wait()
        choices = [self._completion(row) for row in rows]
        if self.job.sampling.greedy:  # greedy choices are identical: generated once, repeated n times
            choices = [choice for choice in choices for _ in range(self.job.sampling.n)]
        first = self.job.first_token_at
        return GenerationResult(choices, self.prompt_tokens,
                                None if first is None else first - self.job.submitted_at)

    def _completion(self, row: RowOutput) -> Completion:
        logprobs = None
        if row.logits is not None:
            top = self.job.sampling.logprobs
            logprobs = _token_logprobs(self.tokenizer, row.logits, torch.tensor(row.tokens), top)
        return Completion(row.text, row.finish_reason or "length", len(row.tokens), logprobs)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt forms (a string, strings, token ids, lists of token ids) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


@dataclass(frozen=True)
class EmbeddingResult:
    embeddings: np.ndarray
    prompt_tokens: int


def _token_logprobs(tokenizer, logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under raw per-step ``logits`` (steps x vocab), with ``top`` alternatives."""
    logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)  # one copy off the GPU, not one per token
    best = logprobs.topk(top, dim=-1) if top else None
    result = []
    for step, token in enumerate(tokens[: len(logprobs)].tolist()):
        alternatives = [] if best is None else [
            (tokenizer.decode([i]), float(v)) for v, i in zip(best.values[step].tolist(), best.indices[step].tolist())]
        result.append(TokenLogprob(tokenizer.decode([token]), float(logprobs[step, token]), alternatives))
    return result


def _token_biases(logit_bias: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias) as (id, bias) pairs, each id checked.

    >>> _token_biases({"7": -100.0, "3": 5}, vocab=10)
    ((3, 5.0), (7, -100.0))
    """
    pairs = []
    for key, bias in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"logit_bias keys are token ids; got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise BadRequest(f"logit_bias token id {token} is not in 0..{vocab - 1}", param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def keep_decoding_off_cudnn_attention(device: str) -> bool:
    """On a CUDA device, turn off PyTorch's cuDNN backend of scaled-dot-product attention for this process; True
    when this call turned it off.

    Why: for bf16 and fp16 inputs on Hopper, SDPA prefers cuDNN attention, which builds an execution plan for every
    new input shape. Decoding makes a new key length every step, and the batcher's batches (rows, prompt lengths,
    shared prefix) rarely repeat a shape, so the plans are seldom reused: on an H100 with torch 2.11, the first
    bf16 ``generate`` of 8 rows spent 4.8 s of its 6.3 s inside ``_cudnn_attention_forward`` (5 ms a call) and the
    engine decoded at 66-124 ms a step in bf16 against 28-50 ms in float32 (which cuDNN attention never takes).
    With cuDNN attention off, SDPA takes flash or memory-efficient attention and bf16 decodes at 25-38 ms a step
    (scripts/probe_bf16_decode.py --sdpa; docs/results.md, 'Where bf16's time went'). The flag is process-wide:
    the embedded server's process is the engine's alone."""
    if torch.device(device).type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


class _ChatModel:
    """A causal LM with its batcher and its cache of compiled grammars."""

    def __init__(self, name: str, role: RoleConfig):
        device = resolve_device(role.device)
        keep_decoding_off_cudnn_attention(device)
        self.model, self.tokenizer = load_causal_lm(name, dtype=DTYPES[role.dtype], device=device)
        self.context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.grammars = GrammarCompilerCache(self.tokenizer, self.model.config.vocab_size)
        self.batcher = Batcher(self.model, self.tokenizer, max_batch_size=role.max_batch_size,
                               max_batch_tokens=role.max_batch_tokens, window_s=role.batch_window_ms / 1000,
                               max_wait_s=role.batch_max_wait_ms / 1000,
                               grammar_processor=GrammarLogitsProcessor, name=name)


class _EmbeddingModel:
    """A sentence encoder, its thread, and the process's cache of what that encoder embedded (None when off)."""

    def __init__(self, name: str, role: RoleConfig):
        self.encoder = load_sentence_encoder(name, device=resolve_device(role.device))
        self.thread = ModelThread(name)
        self.cache = shared_cache(resolve(name), role.embedding_cache_mib)


class _CompressionModel:
    """A set compressor plus the sentence encoder it was trained on (named in its config), or a text
    compressor (a fine-tuned sentence encoder that reads the children's joined texts)."""

    def __init__(self, folder: str, role: RoleConfig):
        self.kind = checkpoint_kind(folder)
        if self.kind == "text-compressor":
            self.model, self.encoder = None, load_text_compressor(folder)
        else:
            # imported here, not with the engine: the set compressor subclasses transformers' PreTrainedModel, whose
            # import costs 5-6 s on 2 cores, which a process that imports the engine without serving a compressor
            # (a data job's client, each of its Ray workers) should not pay
            from overstory.models.compressor import load_compressor

            self.model = load_compressor(folder)
            self.encoder = load_sentence_encoder(self.model.config.encoder)
        self.thread = ModelThread(folder)

    def compress(self, children: list[torch.Tensor]) -> torch.Tensor:
        """The set compressor's embedding of each group of child vectors."""
        from overstory.models.compressor import pad_children  # loaded with the model: no import cost here

        return self.model(*pad_children(children))

    def token_count(self, texts: list[str]) -> int:
        """The encoder tokens actually embedded (after truncation)."""
        encoded = self.encoder.tokenizer(texts, truncation=True, max_length=self.encoder.max_seq_length)
        return sum(len(ids) for ids in encoded["input_ids"])


def _cross_encoder(name: str, role: RoleConfig) -> CrossEncoderModel:
    return CrossEncoderModel(resolve(name), max_documents=role.max_documents)


_MODEL_KINDS = {"chat": _ChatModel, "embedding": _EmbeddingModel, "compression": _CompressionModel,
                "cross-encoder": _cross_encoder}


class EmbeddedEngine:
    """Loads every role of a ``ServeConfig`` and answers chat, completion and embedding calls. Whoever makes one
    closes it (``close``, or ``with EmbeddedEngine(config) as engine``) to free its models."""

    def __init__(self, config: ServeConfig):
        self.config = config
        if config.malloc_arena_max:  # before the models load and the server's threads start
            limit_malloc_arenas(config.malloc_arena_max)
        loaded: dict[tuple[str, str, str, str], object] = {}
        self._models: dict[str, object] = {}
        self._context: dict[str, int] = {}  # per role: roles sharing a model may cap its context differently
        try:
            for role_name, role in config.roles.items():
                # a role with a LoRA adapter loads base + adapter from the adapter folder (PEFT via transformers)
                source = role.adapter or role.model
                key = (source, role.kind, role.dtype, role.device)
                if key not in loaded:
                    loaded[key] = _MODEL_KINDS[role.kind](source, role)
                model = self._models[role_name] = loaded[key]
                if isinstance(model, _ChatModel):
                    if role.max_model_len > model.context:
                        raise ConfigError(f"roles.{role_name}.max_model_len: {role.max_model_len} exceeds the "
                                          f"model's context of {model.context} tokens")
                    self._context[role_name] = role.max_model_len or model.context
        except BaseException:
            self.close()  # the models loaded before the error
            raise

    @property
    def roles(self) -> list[str]:
        return list(self._models)

    def close(self) -> None:
        """End the models' worker threads (a chat model's batcher, an encoder's model thread), which would otherwise
        hold the models in memory for the life of the process: a job or a test suite that starts stacks one after
        another would keep every model it ever served. The engine serves nothing afterwards."""
        for model in {id(model): model for model in self._models.values()}.values():
            if isinstance(model, _ChatModel):
                model.batcher.stop()
            else:  # an embedding, compression or cross-encoder model: one model thread each
                model.thread.close()
        self._models.clear()

    def __enter__(self) -> EmbeddedEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def watch_queues(self, callback: Callable[[str, int, int], None]) -> None:
        """Call ``callback(model, running rows, waiting rows)`` whenever a chat model's batch queue changes;
        ``model`` is the first role served by that model."""
        seen: set[int] = set()
        for role, model in self._models.items():
            if isinstance(model, _ChatModel) and id(model) not in seen:
                seen.add(id(model))
                model.batcher.on_change = lambda running, waiting, role=role: callback(role, running, waiting)

    def _get(self, role: str, kind: type):
        if role not in self._models:
            raise UnknownModel(f"model {role!r} is not served here; served models: {', '.join(self._models)}")
        model = self._models[role]
        if not isinstance(model, kind):
            wanted = {_EmbeddingModel: "an embedding", _CompressionModel: "a compression",
                      CrossEncoderModel: "a cross-encoder (scoring)"}.get(kind, "a chat")
            raise BadRequest(f"model {role!r} is not {wanted} model")
        return model

    def cross_encoder(self, role: str) -> CrossEncoderModel:
        """The cross-encoder serving ``role`` (``/score`` and ``/v1/rerank``)."""
        return self._get(role, CrossEncoderModel)

    def batcher(self, role: str) -> Batcher:
        """The batcher of a chat role's model (its queue depth, the sizes of the batches it ran)."""
        return self._get(role, _ChatModel).batcher

    def tokenizer(self, role: str):
        """The tokenizer of a chat role's model (what prompt_tokens and completion_tokens count)."""
        return self._get(role, _ChatModel).tokenizer

    def max_model_len(self, role: str) -> int:
        """The tokens one request to ``role`` may hold: prompt plus completion for a chat role, the encoder's
        ``max_seq_length`` (longer texts are truncated) for the others."""
        model = self._get(role, object)
        if isinstance(model, _ChatModel):
            return self._context[role]
        if isinstance(model, CrossEncoderModel):
            return model.max_length
        return int(model.encoder.max_seq_length)

    def embedding_dimension(self, role: str) -> int:
        """The length of an embedding role's vectors."""
        return int(self._get(role, _EmbeddingModel).encoder.get_embedding_dimension())

    def chat_role(self, role: str | None) -> str:
        """``role``, or the first chat role when none is named (vLLM's tokenizer endpoints make ``model``
        optional); an unknown or non-chat role is refused as every other request naming it."""
        if role is None:
            role = next((name for name, m in self._models.items() if isinstance(m, _ChatModel)), None)
            if role is None:
                raise BadRequest("no chat model is served here", param="model")
        self._get(role, _ChatModel)
        return role

    def tokenize(self, role: str, prompt: str | None = None, messages: list[dict] | None = None,
                 tools: list[dict] | None = None, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of a text ``prompt`` or of chat ``messages`` rendered as ``start_chat`` renders them.
        ``add_special_tokens`` defaults as in vLLM: on for a prompt, off for messages (the template adds them)."""
        lm = self._get(role, _ChatModel)
        if messages is not None:
            prompt = render_chat_prompt(lm.tokenizer, messages, tools, None)
        add = messages is None if add_special_tokens is None else add_special_tokens
        return list(lm.tokenizer(prompt, add_special_tokens=add)["input_ids"])

    def detokenize(self, role: str, tokens: list[int]) -> str:
        """The text of token ids (special tokens kept, as vLLM's ``/detokenize``)."""
        lm = self._get(role, _ChatModel)
        vocab = lm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise BadRequest(f"token ids must lie in 0..{vocab - 1}", param="tokens")
        return lm.tokenizer.decode(tokens)

    def start_chat(self, role: str, messages: list[dict], tools: list[dict] | None = None,
                   tool_choice: str | dict | None = None, response_format: dict | None = None,
                   on_delta: Callable[[int, str], None] | None = None, **sampling) -> PendingGeneration:
        """Queue a reply to chat ``messages`` (rendered with the role model's chat template, tools included);
        a forced tool call (``tool_choice`` required or named) or ``response_format`` constrains decoding."""
        lm = self._get(role, _ChatModel)
        prompt = render_chat_prompt(lm.tokenizer, messages, tools, tool_choice)
        forced = tool_call_schema(tools or [], tool_choice) if tools else None
        spec = forced if forced is not None else grammar_spec(response_format)
        grammar = lm.grammars.compile(spec) if spec is not None else None
        return self._start(role, lm, [prompt], grammar, on_delta, **sampling)

    def start_completion(self, role: str, prompt: str | list[str] | list[int] | list[list[int]],
                         response_format: dict | None = None, on_delta: Callable[[int, str], None] | None = None,
                         **sampling) -> PendingGeneration:
        """Queue continuations of raw text or token ids (no chat template); every prompt of a list is a row
        of the same batch."""
        lm = self._get(role, _ChatModel)
        spec = grammar_spec(response_format)
        grammar = lm.grammars.compile(spec) if spec is not None else None
        return self._start(role, lm, _prompt_list(prompt), grammar, on_delta, **sampling)

    def chat(self, role: str, messages: list[dict], **options) -> GenerationResult:
        """``start_chat`` and wait for the reply."""
        return self.start_chat(role, messages, **options).result()

    def complete(self, role: str, prompt: str | list[str] | list[int] | list[list[int]], **options) -> GenerationResult:
        """``start_completion`` and wait for the continuations."""
        return self.start_completion(role, prompt, **options).result()

    def _start(self, role: str, lm: _ChatModel, prompts: list[str | list[int]], grammar: object | None,
               on_delta: Callable[[int, str], None] | None, max_tokens: int | None = None, temperature: float = 1.0,
               top_p: float = 1.0, n: int = 1, stop: list[str] | None = None, seed: int | None = None,
               logprobs: int | None = None, top_k: int = 0, min_p: float = 0.0, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
               logit_bias: dict[str, float] | None = None) -> PendingGeneration:
        if n < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise BadRequest("need n >= 1, temperature >= 0 and 0 < top_p <= 1")
        max_tokens = max_tokens or self.config.roles[role].max_new_tokens
        encoded = [p if isinstance(p, list) else lm.tokenizer(p, add_special_tokens=False)["input_ids"]
                   for p in prompts]
        if not encoded or min(len(ids) for ids in encoded) == 0:
            raise BadRequest("prompt must not be empty", param="prompt")
        vocab = lm.model.config.vocab_size
        if any(not 0 <= t < vocab for ids in encoded for t in ids):
            raise BadRequest(f"token ids must lie in 0..{vocab - 1}", param="prompt")
        longest, context = max(len(ids) for ids in encoded), self._context[role]
        if longest + max_tokens > context:
            raise RequestTooLarge(f"this request needs {longest} prompt tokens + {max_tokens} completion tokens "
                                  f"= {longest + max_tokens}, more than the model's context of {context} "
                                  f"tokens; shorten the prompt or lower max_tokens")
        sampling = Sampling(max_tokens, temperature, top_p, n, tuple(stop or ()), seed, logprobs, top_k, min_p,
                            presence_penalty, frequency_penalty, repetition_penalty,
                            _token_biases(logit_bias or {}, vocab))
        job = lm.batcher.submit(Job(encoded, sampling, grammar, on_delta))
        return PendingGeneration(job, lm.tokenizer, sum(len(ids) for ids in encoded))

    def embed(self, role: str, texts: list[str]) -> EmbeddingResult:
        """L2-normalised embeddings (as OpenAI's); texts longer than the encoder's max_seq_length are
        truncated by sentence-transformers, exactly as when the encoder is used directly. Texts this process embedded
        before with the same encoder are read back from its cache (``serving/embedding_cache.py``), with their
        token counts, unless the role's ``embedding_cache_mib`` is 0."""
        model = self._get(role, _EmbeddingModel)
        if not texts:
            return EmbeddingResult(np.zeros((0, model.encoder.get_embedding_dimension()), np.float32), 0)

        def compute(batch: list[str]) -> tuple[np.ndarray, list[int]]:
            def forward() -> tuple[np.ndarray, list[int]]:
                with torch.inference_mode():
                    vectors = model.encoder.encode(batch, normalize_embeddings=True, convert_to_numpy=True,
                                                   show_progress_bar=False)
                encoded = model.encoder.tokenizer(batch, truncation=True, max_length=model.encoder.max_seq_length)
                return vectors, [len(ids) for ids in encoded["input_ids"]]  # the tokens actually embedded

            return model.thread.run(forward)

        if model.cache is None:
            vectors, counts = compute(list(texts))
            return EmbeddingResult(np.asarray(vectors, dtype=np.float32), sum(counts))
        vectors, n_tokens = model.cache.embed(list(texts), compute)
        return EmbeddingResult(vectors, n_tokens)

    def compress(self, role: str, groups: list[list[str]] | None = None,
                 embedding_groups: list[list[list[float]]] | None = None) -> EmbeddingResult:
        """One compressed embedding per group of child chunks, given as texts (embedded here with the
        compressor's own encoder, normalised as in training) or as child embeddings. A text compressor
        reads the children's joined texts, so it takes texts only."""
        comp = self._get(role, _CompressionModel)
        if (groups is None) == (embedding_groups is None):
            raise BadRequest("give either input (groups of child texts) or embeddings (groups of child vectors)")
        sizes = [len(g) for g in (groups if groups is not None else embedding_groups)]
        if not sizes or min(sizes) == 0:
            raise BadRequest("every group needs at least one child")
        if comp.kind == "text-compressor":
            if groups is None:
                raise BadRequest(f"model {role!r} is a text compressor: send the children's texts as input")
            joined = [join_children(group) for group in groups]
            vectors = comp.thread.run(lambda: comp.encoder.encode(joined, convert_to_numpy=True,
                                                                  show_progress_bar=False))
            return EmbeddingResult(np.asarray(vectors, dtype=np.float32), comp.token_count(joined))

        def forward() -> tuple[torch.Tensor, int]:
            n_tokens = 0
            with torch.inference_mode():
                if groups is not None:
                    flat = [text for group in groups for text in group]
                    vectors = torch.from_numpy(comp.encoder.encode(flat, normalize_embeddings=True,
                                                                   convert_to_numpy=True, show_progress_bar=False))
                    n_tokens = comp.token_count(flat)
                    children = list(torch.split(vectors, sizes))
                else:
                    children = [torch.tensor(g, dtype=torch.float32) for g in embedding_groups]
                dim = comp.model.config.embedding_dim
                if any(c.dim() != 2 or c.shape[1] != dim for c in children):
                    raise BadRequest(f"child embeddings must be {dim}-dimensional for this compressor")
                return comp.compress(children), n_tokens

        output, n_tokens = comp.thread.run(forward)
        return EmbeddingResult(output.numpy().astype(np.float32), n_tokens)

