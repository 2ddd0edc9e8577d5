"""Embeddings kept by text for the embedded engine's embedding roles, so a text embedded once is not embedded again
while the process lives.

Jobs embed the same chunks over and over: every stage of ``overstory quickstart`` and every strategy of ``eval
pipeline`` builds its indexes over the same hierarchy through its own stack, and a retrieval server sees the same
queries again. A sentence encoder gives a text the same vector whatever else is in its batch (up to float rounding
in the padded batch, ~1e-7), so a kept vector is as good as a new one. The cache is keyed by the encoder's weights
(its resolved folder, and each weight file's size and modification time there, so a model retrained into the same
folder is not served stale vectors) and shared by every engine of the process that serves that encoder: a stack
started per stage or per test reuses what the last one embedded. Each entry keeps the text's token count too, so
the usage an embeddings call reports is the same whether its texts were kept or embedded. Bounded by bytes (the
role's ``embedding_cache_mib``; engines asking another bound keep a cache of their own), least recently used out
first (cachetools' ``LRUCache`` weighing each entry by its vector's and text's bytes); 0 turns it off for that role.
Nothing is written to disk: a new process starts empty."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
from cachetools import LRUCache

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".onnx")


class _Entry(NamedTuple):
    vector: np.ndarray
    tokens: int
    nbytes: int  # what the entry weighs against the bound: its vector and its text


class EmbeddingCache:
    """Text -> (normalised vector, token count), least recently used out first once ``max_bytes`` is passed."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._entries: LRUCache[str, _Entry] = LRUCache(maxsize=max_bytes, getsizeof=lambda entry: entry.nbytes)
        self._lock = threading.Lock()  # cachetools' caches are not thread-safe

    def __len__(self) -> int:
        return len(self._entries)

    def embed(self, texts: list[str], compute: Callable[[list[str]], tuple[np.ndarray, list[int]]]
              ) -> tuple[np.ndarray, int]:
        """The vectors of ``texts`` (one row each, in order) and their total token count: kept ones read back, the
        rest (each distinct text once) from ``compute``, which returns their vectors and per-text token counts."""
        with self._lock:  # a read marks the entry used
            found = {text: entry for text in dict.fromkeys(texts) if (entry := self._entries.get(text)) is not None}
        missing = [text for text in dict.fromkeys(texts) if text not in found]
        if missing:
            vectors, counts = compute(missing)
            for text, vector, count in zip(missing, vectors, counts, strict=True):
                # a copy: a row view would keep its whole batch alive, past what the byte bound counts
                kept = np.array(vector, dtype=np.float32)
                found[text] = _Entry(kept, int(count), kept.nbytes + len(text))
        with self._lock:
            self.hits += len(texts) - len(missing)
            self.misses += len(missing)
            for text in missing:
                if found[text].nbytes <= self.max_bytes:  # a larger one is never kept (LRUCache would refuse it)
                    self._entries[text] = found[text]
        return np.stack([found[text].vector for text in texts]), sum(found[text].tokens for text in texts)


_CACHES: dict[tuple, EmbeddingCache] = {}
_CACHES_LOCK = threading.Lock()


def weights_key(folder: str) -> tuple:
    """What identifies an encoder's weights: its folder (or hub id) and, for a local folder, each weight file's
    name, size and modification time."""
    path = Path(folder)
    if not path.is_dir():
        return (folder,)
    files = sorted(p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    return (str(path.resolve()), *((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def shared_cache(folder: str, max_mib: float) -> EmbeddingCache | None:
    """The process's cache for the encoder in ``folder`` holding at most ``max_mib`` MiB; None when ``max_mib`` is
    0."""
    if max_mib <= 0:
        return None
    max_bytes = int(max_mib * 2**20)
    with _CACHES_LOCK:
        return _CACHES.setdefault((weights_key(folder), max_bytes), EmbeddingCache(max_bytes))
