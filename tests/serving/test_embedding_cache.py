"""The embedded engine's embedding cache (serving/embedding_cache.py): a kept text is read back, not embedded again,
with the same vector and the same token count; the cache is bounded, keyed by the encoder's weights, shared by the
engines of a process, and off at 0."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError
from overstory.models.registry import MINILM, load_sentence_encoder, resolve
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.embedding_cache import EmbeddingCache, shared_cache
from overstory.serving.engine import EmbeddedEngine


class Counting:
    """A stand-in encoder (no model: what is checked is which texts reach it): a text's vector is its length and
    first letter's code, its token count its word count; every call's texts are recorded."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        self.calls.append(list(texts))
        return np.array([[len(t), ord(t[0])] for t in texts], dtype=np.float32), [len(t.split()) for t in texts]


def test_kept_texts_are_read_back_in_order_with_their_token_counts() -> None:
    cache, encoder = EmbeddingCache(max_bytes=2**20), Counting()
    vectors, tokens = cache.embed(["a b", "c", "a b"], encoder)
    assert encoder.calls == [["a b", "c"]]  # a repeated text is embedded once
    assert vectors.tolist() == [[3, 97], [1, 99], [3, 97]] and tokens == 5  # each occurrence counts its tokens
    vectors, tokens = cache.embed(["c", "new one", "a b"], encoder)
    assert encoder.calls[1:] == [["new one"]] and vectors.tolist() == [[1, 99], [7, 110], [3, 97]] and tokens == 5
    assert (cache.hits, cache.misses, len(cache)) == (3, 3, 3)


def test_the_least_recently_used_go_first_and_an_entry_too_big_is_not_kept() -> None:
    entry = 2 * 4 + 1  # two float32 and a one-character text
    cache, encoder = EmbeddingCache(max_bytes=2 * entry), Counting()
    cache.embed(["a", "b"], encoder)
    cache.embed(["a"], encoder)  # "a" used again: "b" is now the oldest
    cache.embed(["c"], encoder)
    cache.embed(["a", "b"], encoder)
    assert encoder.calls == [["a", "b"], ["c"], ["b"]]
    tiny = EmbeddingCache(max_bytes=entry - 1)
    tiny.embed(["a"], encoder)
    assert len(tiny) == 0


def test_one_cache_per_encoder_weights_shared_and_off_at_zero(tmp_path: Path) -> None:
    folder = tmp_path / "encoder"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"v1")
    first = shared_cache(str(folder), 1)
    assert shared_cache(str(folder), 1) is first and first.max_bytes == 2**20
    assert shared_cache(str(folder), 2) is not first  # another bound, a cache of its own: none shrinks another's
    assert shared_cache(str(folder), 0) is None
    weights.write_bytes(b"v2, retrained")  # other weights in the same folder: not the old vectors
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 1))
    assert shared_cache(str(folder), 1) is not first
    benchmarked = ServeConfig.local().without_embedding_cache()  # benches measure the encoder, not the cache
    assert benchmarked.roles["embedder"].embedding_cache_mib == 0
    assert benchmarked.roles["generator"] == ServeConfig.local().roles["generator"]
    with pytest.raises(ConfigError, match="embedding_cache_mib must be >= 0"):
        RoleConfig(model=MINILM, kind="embedding", embedding_cache_mib=-1)


def test_the_engine_reads_kept_embeddings_back_as_it_embedded_them() -> None:
    """Two engines of one process serving MiniLM share its cache: the second answers texts the first embedded with
    the same vectors and usage without embedding them; with the cache off, it embeds them again, alike."""
    config = ServeConfig.local(port=0)
    texts = [f"The embedding cache test's sentence number {i}, {time.time_ns()}." for i in range(3)]
    with EmbeddedEngine(replace(config, roles={"embedder": config.roles["embedder"]})) as engine:
        first = engine.embed("embedder", texts)
    cache = shared_cache(resolve(MINILM), config.roles["embedder"].embedding_cache_mib)
    hits = cache.hits
    with EmbeddedEngine(replace(config, roles={"embedder": config.roles["embedder"]})) as engine:
        again = engine.embed("embedder", [texts[1], texts[0], texts[1]])
    assert cache.hits == hits + 3
    assert again.embeddings.tolist() == first.embeddings[[1, 0, 1]].tolist()  # bit for bit: read back
    encoder = load_sentence_encoder(MINILM)
    counts = [len(ids) for ids in encoder.tokenizer(texts)["input_ids"]]
    assert first.prompt_tokens == sum(counts) and again.prompt_tokens == 2 * counts[1] + counts[0]
    direct = encoder.encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(first.embeddings, direct, atol=1e-5)
    off = replace(config.roles["embedder"], embedding_cache_mib=0)
    with EmbeddedEngine(replace(config, roles={"embedder": off})) as engine:
        fresh = engine.embed("embedder", texts)
    assert cache.hits == hits + 3 and fresh.prompt_tokens == first.prompt_tokens
    np.testing.assert_allclose(fresh.embeddings, first.embeddings, atol=1e-5)
