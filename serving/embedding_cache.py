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
role's ``embedding_cache_mib``), least recently used out first; 0 turns it off for that role. Nothing is written to
disk: a new process starts empty."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".onnx")


class EmbeddingCache:
    """Text -> (normalised vector, token count), least recently used out first once ``max_bytes`` is passed."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.hits = self.misses = 0
        self._entries: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def embed(self, texts: list[str], compute: Callable[[list[str]], tuple[np.ndarray, list[int]]]
              ) -> tuple[np.ndarray, int]:
        """The vectors of ``texts`` (one row each, in order) and their total token count: kept ones read back, the
        rest (each distinct text once) from ``compute``, which returns their vectors and per-text token counts."""
        with self._lock:
            kept = {text: self._entries[text] for text in texts if text in self._entries}
            for text in kept:
                self._entries.move_to_end(text)
        missing = list(dict.fromkeys(text for text in texts if text not in kept))
        found = dict(kept)
        if missing:
            vectors, counts = compute(missing)
            # copies: a row view would keep its whole batch alive, past what the byte bound counts
            found |= {text: (np.array(vector, dtype=np.float32), int(count))
                      for text, vector, count in zip(missing, vectors, counts, strict=True)}
        with self._lock:
            self.hits += len(texts) - len(missing)
            self.misses += len(missing)
            for text in missing:
                self._add(text, found[text])
        return np.stack([found[text][0] for text in texts]), sum(found[text][1] for text in texts)

    def _add(self, text: str, entry: tuple[np.ndarray, int]) -> None:
        if text in self._entries:
            return
        size = entry[0].nbytes + len(text)
        if size > self.max_bytes:
            return
        self._entries[text] = entry
        self._bytes += size
        while self._bytes > self.max_bytes:
            old_text, (old_vector, _) = self._entries.popitem(last=False)
            self._bytes -= old_vector.nbytes + len(old_text)


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
    """The process's cache for the encoder in ``folder``, holding at most ``max_mib`` MiB (the latest engine's
    bound applies to all); None when ``max_mib`` is 0."""
    if max_mib <= 0:
        return None
    key = weights_key(folder)
    with _CACHES_LOCK:
        cache = _CACHES.setdefault(key, EmbeddingCache(int(max_mib * 2**20)))
        cache.max_bytes = int(max_mib * 2**20)
    return cache
