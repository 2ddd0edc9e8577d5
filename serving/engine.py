"""The embedded engine: transformers models behind the served roles, on CPU by default.

Generation is transformers' own ``model.generate`` with a ``GenerationConfig`` built from the
request (greedy at temperature 0, sampling otherwise, ``stop_strings`` for stop sequences); chat
prompts go through the model's own chat template, and a list of completion prompts runs as one
left-padded batch. Roles naming the same model share one copy in memory; a lock per model
serialises generation on it (uvicorn runs handlers in a thread pool).
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import GenerationConfig

from overstory.core.config import ConfigError
from overstory.models.compressor import load_compressor, pad_children
from overstory.models.registry import load_causal_lm, load_sentence_encoder
from overstory.models.text_compressor import checkpoint_kind, join_children, load_text_compressor
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.errors import BadRequest, RequestTooLarge, UnknownModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Sampling draws from torch's global generator, so a seeded request is reproducible only if no other
# sampled generation (on another model) runs at the same time; greedy decoding never takes this lock.
_SAMPLING_LOCK = threading.Lock()


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

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)


@dataclass(frozen=True)
class EmbeddingResult:
    embeddings: np.ndarray
    prompt_tokens: int


def _token_logprobs(tokenizer, logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under raw per-step ``logits`` (steps x vocab), with ``top`` alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.topk(top, dim=-1) if top else None
    result = []
    for step, token in enumerate(tokens[: len(logprobs)].tolist()):
        alternatives = [] if best is None else [
            (tokenizer.decode([i]), float(v)) for v, i in zip(best.values[step].tolist(), best.indices[step].tolist())]
        result.append(TokenLogprob(tokenizer.decode([token]), float(logprobs[step, token]), alternatives))
    return result


class _ChatModel:
    def __init__(self, name: str, role: RoleConfig):
        self.model, self.tokenizer = load_causal_lm(name, dtype=DTYPES[role.dtype])
        self.context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.lock = threading.Lock()


class _EmbeddingModel:
    def __init__(self, name: str, role: RoleConfig):
        self.encoder = load_sentence_encoder(name)
        self.lock = threading.Lock()


class _CompressionModel:
    """A set compressor plus the sentence encoder it was trained on (named in its config), or a text
    compressor (a fine-tuned sentence encoder that reads the children's joined texts)."""

    def __init__(self, folder: str, role: RoleConfig):
        self.kind = checkpoint_kind(folder)
        if self.kind == "text-compressor":
            self.model, self.encoder = None, load_text_compressor(folder)
        else:
            self.model = load_compressor(folder)
            self.encoder = load_sentence_encoder(self.model.config.encoder)
        self.lock = threading.Lock()

    def token_count(self, texts: list[str]) -> int:
        """The encoder tokens actually embedded (after truncation)."""
        encoded = self.encoder.tokenizer(texts, truncation=True, max_length=self.encoder.max_seq_length)
        return sum(len(ids) for ids in encoded["input_ids"])


_MODEL_KINDS = {"chat": _ChatModel, "embedding": _EmbeddingModel, "compression": _CompressionModel}


class EmbeddedEngine:
    """Loads every role of a ``ServeConfig`` and answers chat, completion and embedding calls."""

    def __init__(self, config: ServeConfig):
        self.config = config
        loaded: dict[tuple[str, str, str], object] = {}
        self._models: dict[str, object] = {}
        self._context: dict[str, int] = {}  # per role: roles sharing a model may cap its context differently
        for role_name, role in config.roles.items():
            # a role with a LoRA adapter loads base + adapter from the adapter folder (PEFT via transformers)
            source = role.adapter or role.model
            key = (source, role.kind, role.dtype)
            if key not in loaded:
                loaded[key] = _MODEL_KINDS[role.kind](source, role)
            model = self._models[role_name] = loaded[key]
            if isinstance(model, _ChatModel):
                if role.max_model_len > model.context:
                    raise ConfigError(f"roles.{role_name}.max_model_len: {role.max_model_len} exceeds the "
                                      f"model's context of {model.context} tokens")
                self._context[role_name] = role.max_model_len or model.context

    @property
    def roles(self) -> list[str]:
        return list(self._models)

    def _get(self, role: str, kind: type):
        if role not in self._models:
            raise UnknownModel(f"model {role!r} is not served here; served models: {', '.join(self._models)}")
        model = self._models[role]
        if not isinstance(model, kind):
            wanted = {_EmbeddingModel: "an embedding", _CompressionModel: "a compression"}.get(kind, "a chat")
            raise BadRequest(f"model {role!r} is not {wanted} model")
        return model

    def tokenizer(self, role: str):
        """The tokenizer of a chat role's model (what prompt_tokens and completion_tokens count)."""
        return self._get(role, _ChatModel).tokenizer

    def chat(self, role: str, messages: list[dict[str, str]], **sampling) -> GenerationResult:
        """Generate a reply to chat ``messages`` with the role model's chat template."""
        lm = self._get(role, _ChatModel)
        for i, message in enumerate(messages):
            if message.get("role") not in ("system", "user", "assistant"):
                raise BadRequest(f"messages[{i}].role must be system, user or assistant")
        prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._generate(role, lm, [prompt], **sampling)

    def complete(self, role: str, prompt: str | list[str], **sampling) -> GenerationResult:
        """Continue raw text (no chat template); a list of prompts is generated as one batch."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return self._generate(role, self._get(role, _ChatModel), prompts, **sampling)

    def _generate(self, role: str, lm: _ChatModel, prompts: list[str], max_tokens: int | None = None,
                  temperature: float = 1.0, top_p: float = 1.0, n: int = 1, stop: list[str] | None = None,
                  seed: int | None = None, logprobs: int | None = None) -> GenerationResult:
        """``logprobs``: None for none, k >= 0 for each generated token's log-probability and its k best
        alternatives."""
        if n < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise BadRequest("need n >= 1, temperature >= 0 and 0 < top_p <= 1")
        max_tokens = max_tokens or self.config.roles[role].max_new_tokens
        encoded = [lm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        if not encoded or min(len(ids) for ids in encoded) == 0:
            raise BadRequest("prompt must not be empty")
        longest, context = max(len(ids) for ids in encoded), self._context[role]
        if longest + max_tokens > context:
            raise RequestTooLarge(f"this request needs {longest} prompt tokens + {max_tokens} completion tokens "
                                  f"= {longest + max_tokens}, more than the model's context of {context} "
                                  f"tokens; shorten the prompt or lower max_tokens")
        inputs = lm.tokenizer.pad({"input_ids": encoded}, padding=True, padding_side="left", return_tensors="pt")
        greedy = temperature == 0
        config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=not greedy,
            # greedy choices are identical, so greedy generates each prompt once and repeats the choice
            num_return_sequences=1 if greedy else n,
            temperature=None if greedy else temperature, top_p=None if greedy else top_p, top_k=None,
            stop_strings=list(stop) if stop else None,
            eos_token_id=lm.tokenizer.eos_token_id, pad_token_id=lm.tokenizer.pad_token_id,
            output_logits=logprobs is not None, return_dict_in_generate=True,
        )
        rng = nullcontext() if greedy else _SAMPLING_LOCK
        with lm.lock, rng, torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            output = lm.model.generate(**inputs, generation_config=config, tokenizer=lm.tokenizer)
        width = inputs["input_ids"].shape[1]
        choices = []
        for r, row in enumerate(output.sequences):
            choice = self._decode(lm, row[width:], max_tokens, stop)
            if logprobs is not None:
                steps = torch.stack([step[r] for step in output.logits[:choice.completion_tokens]])
                choice = replace(choice, logprobs=_token_logprobs(lm.tokenizer, steps, row[width:], logprobs))
            choices.append(choice)
        if greedy:
            choices = [choice for choice in choices for _ in range(n)]
        return GenerationResult(choices, sum(len(ids) for ids in encoded))

    @staticmethod
    def _decode(lm: _ChatModel, tokens: torch.Tensor, max_tokens: int, stop: list[str] | None) -> Completion:
        ids = tokens.tolist()
        eos = lm.tokenizer.eos_token_id
        ended = eos in ids
        if ended:
            ids = ids[: ids.index(eos) + 1]  # the end-of-sequence token counts as generated
        text = lm.tokenizer.decode(ids, skip_special_tokens=True)
        cut = min((i for s in stop or [] if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            # OpenAI leaves the stop string out; an end token after it is batch padding, not generated
            return Completion(text[:cut], "stop", len(ids) - int(ended))
        return Completion(text, "stop" if ended or len(ids) < max_tokens else "length", len(ids))

    def embed(self, role: str, texts: list[str]) -> EmbeddingResult:
        """L2-normalised embeddings (as OpenAI's); texts longer than the encoder's max_seq_length are
        truncated by sentence-transformers, exactly as when the encoder is used directly."""
        model = self._get(role, _EmbeddingModel)
        if not texts:
            return EmbeddingResult(np.zeros((0, model.encoder.get_sentence_embedding_dimension()), np.float32), 0)
        with model.lock, torch.inference_mode():
            vectors = model.encoder.encode(list(texts), normalize_embeddings=True, convert_to_numpy=True,
                                           show_progress_bar=False)
            encoded = model.encoder.tokenizer(list(texts), truncation=True, max_length=model.encoder.max_seq_length)
        n_tokens = sum(len(ids) for ids in encoded["input_ids"])  # the tokens actually embedded
        return EmbeddingResult(np.asarray(vectors, dtype=np.float32), n_tokens)

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
            with comp.lock:
                vectors = comp.encoder.encode(joined, convert_to_numpy=True, show_progress_bar=False)
            return EmbeddingResult(np.asarray(vectors, dtype=np.float32), comp.token_count(joined))
        n_tokens = 0
        with comp.lock, torch.inference_mode():
            if groups is not None:
                flat = [text for group in groups for text in group]
                vectors = torch.from_numpy(comp.encoder.encode(flat, normalize_embeddings=True, convert_to_numpy=True,
                                                               show_progress_bar=False))
                n_tokens = comp.token_count(flat)
                children = list(torch.split(vectors, sizes))
            else:
                children = [torch.tensor(g, dtype=torch.float32) for g in embedding_groups]
            dim = comp.model.config.embedding_dim
            if any(c.dim() != 2 or c.shape[1] != dim for c in children):
                raise BadRequest(f"child embeddings must be {dim}-dimensional for this compressor")
            output = comp.model(*pad_children(children))
        return EmbeddingResult(output.numpy().astype(np.float32), n_tokens)

