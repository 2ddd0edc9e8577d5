"""Design (b) of the chunk compression encoder: the sentence encoder itself, fine-tuned on child texts.

SmartChunk initialises its compressor from the SBERT encoder. Read literally, that is a
sentence-transformers model that takes the children's text and is trained so that its embedding
lands on e_gt, the embedding of the group's LLM summary. Its input is the children's texts joined
in order (``join_children``), truncated as the encoder truncates (MiniLM: 256 word pieces), so it
sees more than ``mean_pool`` (word order, the whole group at once) but only the start of a long
section. Design (a), ``models/compressor.py``, reads child vectors instead and sees every child.

The checkpoint is a plain sentence-transformers folder (``SentenceTransformer(folder)`` loads it)
plus the ``overstory.json`` manifest with ``"kind": "text-compressor"``; ``checkpoint_kind`` tells
the two designs apart so one ``compressor`` role can serve either.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KINDS = ("set-compressor", "text-compressor")


def join_children(texts: list[str]) -> str:
    """The text compressor's input for one group: the children's texts in document order.

    >>> join_children(["First sentence.", "  Second one. "])
    'First sentence.\\nSecond one.'
    """
    return "\n".join(t.strip() for t in texts)


def checkpoint_kind(folder: str | Path) -> str:
    """``set-compressor`` or ``text-compressor``, read from the checkpoint's overstory.json."""
    manifest = Path(folder) / "overstory.json"
    if not manifest.exists():
        raise FileNotFoundError(f"{folder} is not a compressor checkpoint (overstory.json missing); train one with "
                                f"`overstory train compressor` or `overstory train text_compressor`")
    kind = json.loads(manifest.read_text()).get("kind", "set-compressor")
    if kind not in KINDS:
        raise ValueError(f"{folder}: unknown compressor kind {kind!r} in overstory.json (expected one of {KINDS})")
    return kind


def save_text_compressor(model, folder: str | Path, encoder: str, manifest: dict[str, Any]) -> Path:
    """Save a fine-tuned SentenceTransformer with the manifest that marks it as a text compressor."""
    folder = Path(folder)
    model.save(str(folder))
    (folder / "overstory.json").write_text(json.dumps(
        {"kind": "text-compressor", "encoder": encoder, **manifest}, indent=2, default=str))
    return folder


def load_text_compressor(folder: str | Path, embedding_dim: int | None = None, device: str = "cpu"):
    """Load a text compressor; with ``embedding_dim``, refuse one whose vectors have another size."""
    from sentence_transformers import SentenceTransformer

    if checkpoint_kind(folder) != "text-compressor":
        raise ValueError(f"{folder} is a set compressor (it reads child embeddings, not texts)")
    model = SentenceTransformer(str(folder), device=device)
    dim = model.get_embedding_dimension()
    if embedding_dim is not None and dim != embedding_dim:
        raise ValueError(f"{folder} gives {dim}-dim embeddings, but this encoder gives {embedding_dim}-dim vectors")
    return model
