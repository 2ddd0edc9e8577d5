"""The role a trained checkpoint serves, read from the ``overstory.json`` manifest its recipe wrote beside it, so
that ``overstory serve --model DIR`` (a full model folder) or ``--adapter DIR`` (a PEFT LoRA adapter) serves it
without a roles file.

Every recipe's manifest has a ``kind``; with the folder's own files it decides the role and how it is served:

    recipe (its final folder)                   manifest                         role        served as
    planner_sft, planner_grpo, stitch (final)   kind: planner, base_model        planner     chat
    distill_scorer student=llm (final)          kind: scorer, student: llm       scorer      chat
    distill_scorer student=cross_encoder        kind: scorer,                    scorer      cross-encoder (with
      (final)                                     student: cross_encoder                      its saved activation)
    compressor (best)                           kind: set-compressor, encoder    compressor  compression
    text_compressor (best)                      kind: text-compressor, encoder   compressor  compression

Whether the folder is an adapter is read from the folder itself (``adapter_config.json``), not from the manifest's
``adapter`` flag: a merged LoRA (``lora.merge: true``) is a full model. An adapter is served on its base model:
the manifest's ``base_model``, else the adapter's ``base_model_name_or_path``. A compressor works on the vectors of
the encoder it was trained on, so that encoder is the embedder the stack gets when no embedder is configured;
every other checkpoint gets the built-in MiniLM, as the shipped roles files have it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overstory.core.config import ConfigError
from overstory.models.registry import MINILM, base_model_of

MANIFEST = "overstory.json"
ADAPTER_CONFIG = "adapter_config.json"
# manifest kind -> (role, serving kind); a scorer's serving kind depends on its student (SCORER_KINDS)
ROLE_OF_KIND = {"planner": ("planner", "chat"), "scorer": ("scorer", ""),
                "set-compressor": ("compressor", "compression"), "text-compressor": ("compressor", "compression")}
SCORER_KINDS = {"llm": "chat", "cross_encoder": "cross-encoder"}
ROLE_EXAMPLE = "roles: {planner: {model: BASE, adapter: DIR}} or roles: {scorer: {model: DIR, kind: cross-encoder}}"


@dataclass(frozen=True)
class CheckpointRole:
    """What a checkpoint folder serves: its role, the serving kind, the model to load (an adapter's base model),
    the adapter folder (or ""), and the embedding model the stack should embed with."""

    role: str
    kind: str
    model: str
    adapter: str
    embedder: str


def checkpoint_role(folder: str, adapter: bool) -> CheckpointRole:
    """The role of the checkpoint in ``folder``, given as ``--adapter`` (``adapter``) or ``--model``.

    Raises ConfigError naming the flag and what the folder lacks: no such folder, no manifest, a manifest naming no
    role, an adapter given as a model or a full model given as an adapter.
    """
    flag = "adapter" if adapter else "model"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{flag}={folder}: no such checkpoint folder")
    manifest = _read_manifest(path, flag)
    role, kind = _role_and_kind(manifest, path, flag)
    is_adapter = (path / ADAPTER_CONFIG).exists()
    if is_adapter and not adapter:
        raise ConfigError(f"model={folder} holds a LoRA adapter ({ADAPTER_CONFIG}): serve it with --adapter {folder}")
    if adapter and not is_adapter:
        raise ConfigError(f"adapter={folder} has no {ADAPTER_CONFIG}, so it is a full model (or not a PEFT adapter): "
                          f"serve it with --model {folder}")
    encoder = manifest.get("encoder", MINILM) if role == "compressor" else MINILM
    if adapter:
        return CheckpointRole(role, kind, base_model_of(str(path)), str(path), encoder)
    return CheckpointRole(role, kind, str(path), "", encoder)


def _read_manifest(path: Path, flag: str) -> dict[str, Any]:
    """The folder's overstory.json as a dict; a missing or unreadable one is refused with how to serve it anyway."""
    manifest = path / MANIFEST
    if not manifest.exists():
        raise ConfigError(f"{flag}={path}: the folder has no {MANIFEST}, the manifest every overstory recipe writes "
                          f"beside its final checkpoint, so the role it serves is unknown. Point at a recipe's final "
                          f"folder (out/final, or out/best for a compressor), or serve this folder with a roles file "
                          f"(overstory serve --config FILE, with {ROLE_EXAMPLE})")
    try:
        loaded = json.loads(manifest.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}={path}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{flag}={path}: {MANIFEST} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def _role_and_kind(manifest: dict[str, Any], path: Path, flag: str) -> tuple[str, str]:
    """(role, serving kind) from the manifest's ``kind`` (and a scorer's ``student``)."""
    kind = manifest.get("kind")
    if kind not in ROLE_OF_KIND:
        raise ConfigError(f"{flag}={path}: {MANIFEST} names no role (kind: {kind!r}; a served checkpoint's kind is "
                          f"one of {', '.join(ROLE_OF_KIND)}). Serve the folder with a roles file instead "
                          f"(overstory serve --config FILE, with {ROLE_EXAMPLE})")
    role, serving_kind = ROLE_OF_KIND[kind]
    if role == "scorer":
        student = manifest.get("student")
        if student not in SCORER_KINDS:
            raise ConfigError(f"{flag}={path}: {MANIFEST} is a scorer's but its student is {student!r} (expected "
                              f"one of {', '.join(SCORER_KINDS)}), so how to serve it is unknown")
        serving_kind = SCORER_KINDS[student]
    return role, serving_kind
