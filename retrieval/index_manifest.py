"""The manifest saved with every flat index, and the versioned folder layout that makes a save atomic
(``save_index`` / ``load_saved``: what the indexes of retrieval/index.py call to save and load themselves).

A saved index folder holds one complete version per save and a ``current`` symlink naming the version to read::

    <folder>/current -> v-<id>           swapped by one rename, after the new version is complete
    <folder>/v-<id>/manifest.json        format_version, kind, corpus_hash, n_chunks, n_documents,
                                         embedding_model, settings
    <folder>/v-<id>/index.json, chunks.jsonl, ...   the index's own files (retrieval/index.py)

Why not rename a sibling folder over the old one: POSIX cannot rename a directory onto a non-empty one, so that swap
takes two renames with a moment in between where the folder is missing, and a reader that opens the files one by one
could read some from the old index and some from the new. Renaming a symlink over ``current`` is one atomic step; a
reader resolves ``current`` once and reads every file from that version. The version before the newest is kept, so a
reader that resolved it just before a save still finds its files; a reader slower than two saves finds its version
gone and reads again (``read_versioned``). One writer at a time: two concurrent saves to one folder are not ordered.

``corpus_hash`` is the SHA-256 of the indexed chunks sorted by id, each chunk's id and the text that was indexed
(title and text), so it names the set of chunks whatever their row order. Loading recomputes it from the chunks read
and refuses a folder whose chunks do not match its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from overstory.core.records import Chunk

FORMAT_VERSION = 1
CURRENT = "current"
MANIFEST = "manifest.json"
# The files an index folder held before versioned saves; a save into such a folder removes them once `current` exists.
LEGACY_NAMES = ("index.json", "chunks.jsonl", "embeddings.npy", "dense", "bm25")
T = TypeVar("T")


class IndexMismatchError(ValueError):
    """A saved index that is not the one the caller asked for (another embedding model, setting or format) or
    whose files disagree with its manifest."""


def corpus_hash(chunks: Iterable[tuple[str, str]]) -> str:
    """SHA-256 of ``(chunk id, indexed text)`` pairs, sorted by id: the same set of chunks gives the same hash.

    >>> corpus_hash([("b", "y"), ("a", "x")]) == corpus_hash([("a", "x"), ("b", "y")])
    True
    >>> corpus_hash([("a", "x")]) == corpus_hash([("a", "x2")])
    False
    """
    pairs = sorted(chunks)
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def current_version(folder: str | Path) -> Path | None:
    """The version folder ``current`` names, or None for a folder saved before versioned saves (or no index)."""
    link = Path(folder) / CURRENT
    return Path(folder) / os.readlink(link) if link.is_symlink() else None


def save_versioned(folder: str | Path, write: Callable[[Path], None]) -> Path:
    """Write a new version with ``write(version_folder)``, then point ``current`` at it in one rename; returns it.

    Keeps the version ``current`` named before (a reader may be reading it) and removes older ones, unfinished
    versions of interrupted saves, and the files of the layout before versioned saves.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    previous = current_version(folder)
    version = folder / f"v-{uuid.uuid4().hex[:16]}"
    write(version)
    link = folder / f".{CURRENT}-{uuid.uuid4().hex[:8]}"
    os.symlink(version.name, link)
    os.replace(link, folder / CURRENT)
    keep = {version.name, previous.name if previous else None}
    for old in folder.iterdir():
        if (old.name.startswith("v-") and old.name not in keep) or old.name in LEGACY_NAMES:
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
    return version


def read_versioned(folder: str | Path, read: Callable[[Path, bool], T], attempts: int = 3) -> T:
    """``read(files_folder, versioned)`` on the version ``current`` names (or on ``folder`` itself when it was saved
    before versioned saves); read again when a save removed that version while it was being read."""
    for _ in range(attempts - 1):
        version = current_version(folder)
        try:
            return read(version or Path(folder), version is not None)
        except FileNotFoundError:
            if version is None or current_version(folder) == version:
                raise  # missing from the version still current: the folder is incomplete, not replaced
    version = current_version(folder)
    return read(version or Path(folder), version is not None)


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    (folder / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=2,
                                              sort_keys=True))


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{folder} has no {MANIFEST}")
    return json.loads(path.read_text())


def _plain(value: Any) -> Any:
    """A value as JSON stores it (tuples become lists), so a setting compares equal to its saved copy."""
    return json.loads(json.dumps(value))


def check_manifest(manifest: Mapping[str, Any], folder: str | Path, embedding_model: str | None = None,
                   settings: Mapping[str, Any] | None = None) -> None:
    """Refuse a saved index written in another format, with another embedding model than ``embedding_model`` (when
    both are known) or with other values of ``settings``' keys; each error names the setting and both values.

    >>> check_manifest({"format_version": 1, "embedding_model": "a", "settings": {"k1": 1.5}}, "f", "a", {"k1": 1.5})
    >>> check_manifest({"format_version": 1, "embedding_model": "a", "settings": {}}, "f", "b")
    Traceback (most recent call last):
    ...
    overstory.retrieval.index_manifest.IndexMismatchError: f: embedding_model is 'a' in the saved index but the ...
    """
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise IndexMismatchError(f"{folder}: format_version is {found!r} in the saved index but this overstory reads "
                                 f"{FORMAT_VERSION}; rebuild the index")
    recorded = manifest.get("embedding_model")
    if embedding_model is not None and recorded is not None and recorded != embedding_model:
        raise IndexMismatchError(f"{folder}: embedding_model is {recorded!r} in the saved index but the caller embeds "
                                 f"with {embedding_model!r}; rebuild the index with {embedding_model!r} or load it "
                                 f"with {recorded!r}")
    saved = manifest.get("settings", {})
    for key, value in (settings or {}).items():
        if key not in saved or saved[key] != _plain(value):
            raise IndexMismatchError(f"{folder}: setting {key!r} is {saved.get(key, '<not recorded>')!r} in the saved "
                                     f"index but the caller asks for {_plain(value)!r}")


def check_contents(manifest: Mapping[str, Any], folder: str | Path, kind: str, n_chunks: int, hashed: str) -> None:
    """Refuse a folder whose index kind, chunk count or corpus hash differ from its manifest's."""
    for key, value in (("kind", kind), ("n_chunks", n_chunks), ("corpus_hash", hashed)):
        if manifest.get(key) != value:
            raise IndexMismatchError(f"{folder}: {key} is {manifest.get(key)!r} in manifest.json but the files read "
                                     f"give {value!r}; the folder was altered after it was saved")


def chunk_text_for_index(chunk: Chunk) -> str:
    """What gets indexed: the document title gives the chunk its context (as in HotpotQA's setup)."""
    return f"{chunk.title}\n{chunk.text}" if chunk.title else chunk.text


def chunks_hash(chunks: Iterable[Chunk]) -> str:
    """The manifest's ``corpus_hash`` of these chunks: their ids and indexed texts (``index_manifest.corpus_hash``)."""
    return corpus_hash((c.id, chunk_text_for_index(c)) for c in chunks)


def index_manifest(index: Any) -> dict[str, Any]:
    """What ``save`` writes to manifest.json beside the format version."""
    chunks = index.chunks
    return {"kind": index.kind, "corpus_hash": chunks_hash(chunks), "n_chunks": len(chunks),
            "n_documents": len({c.doc_id for c in chunks}), "embedding_model": index.embedding_model,
            "settings": index.settings}


def write_index_files(index: Any, folder: Path) -> None:
    """An index's files and its manifest in ``folder`` (one version of a flat index, or a part of a strategy's saved
    index: retrieval/api.py's ``Retriever.save``)."""
    manifest = index_manifest(index)  # settings checked (no clash) before anything is written
    index._write(folder)
    write_manifest(folder, manifest)


def save_index(index: Any, folder: str | Path) -> Path:
    """Save a flat index (its ``_write``) as a new version of ``folder``, with its manifest."""
    index_manifest(index)  # settings checked (no clash) before a version folder is made
    return save_versioned(folder, lambda version: write_index_files(index, version))


def read_index_files(cls, files: Path, folder: str | Path, embed: Callable[[list[str]], Any] | None,
                     embedding_model: str | None, settings: Mapping[str, Any] | None):
    """The index ``cls`` wrote in ``files`` with its manifest, checked before (model, settings, format) and after
    (kind, chunk count, corpus hash) reading; errors name ``folder``."""
    manifest = read_manifest(files)
    check_manifest(manifest, folder, embedding_model, settings)
    index = cls._read(files, embed, manifest.get("embedding_model"))
    check_contents(manifest, folder, index.kind, len(index.chunks), chunks_hash(index.chunks))
    own = index.settings  # the index's own settings only: _read records no extra ones
    index.extra_settings = {k: v for k, v in manifest.get("settings", {}).items() if k not in own}
    return index


def load_saved(cls, folder: str | Path, embed: Callable[[list[str]], Any] | None, embedding_model: str | None,
          settings: Mapping[str, Any] | None):
    """Read the index ``cls`` saved in ``folder`` from one version, checking its manifest before and after."""

    def read(files: Path, versioned: bool):
        if not versioned:
            warnings.warn(f"{folder} has no manifest (saved before manifests were written): loaded without checking "
                          "its embedding model, settings or format; save it again to write one", stacklevel=4)
            return cls._read(files, embed, None)
        return read_index_files(cls, files, folder, embed, embedding_model, settings)

    return read_versioned(folder, read)
