"""/v1/compress over HTTP with a compressor checkpoint on the real MiniLM encoder."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from overstory.core.config import ConfigError
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM, load_sentence_encoder
from overstory.models.text_compressor import join_children, save_text_compressor
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import serve_in_background

GROUPS = [["The Normans were a people of Normandy.", "They descended from Norse raiders."],
          ["P versus NP is a major open problem."]]


@pytest.fixture(scope="module")
def compress_url(tmp_path_factory):
    folder = save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)),
                             tmp_path_factory.mktemp("ckpt") / "compressor", {})
    config = ServeConfig(port=0, roles={"compressor": RoleConfig(model=str(folder), kind="compression"),
                                        "embedder": RoleConfig(model=MINILM, kind="embedding")})
    with serve_in_background(config) as url:
        yield url


def test_compress_texts_and_embeddings(compress_url: str) -> None:
    client = Client.from_url(compress_url)
    from_texts = client.compress("compressor", groups=GROUPS)
    assert from_texts.shape == (2, 384)
    # an untrained compressor is the mean of its children's (normalised) embeddings
    children = [client.embed("embedder", group) for group in GROUPS]
    np.testing.assert_allclose(from_texts, np.stack([c.mean(0) for c in children]), atol=1e-5)
    np.testing.assert_allclose(client.compress("compressor", embeddings=children), from_texts, atol=1e-5)
    assert client.stats.summary()["compressor"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("payload", "reason"), [
    ({"model": "compressor", "input": [["a"], []]}, "at least one child"),
    ({"model": "compressor", "embeddings": [[[0.1, 0.2]]]}, "384-dimensional"),
    ({"model": "compressor"}, "either input"),
    ({"model": "embedder", "input": [["a"]]}, "not a compression model"),
])
def test_compress_errors(compress_url: str, payload: dict, reason: str) -> None:
    response = httpx.post(f"{compress_url}/v1/compress", json=payload, timeout=30)
    assert response.status_code == 400 and reason in response.json()["error"]["message"]


def test_compressor_role_needs_compression_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="roles.compressor.kind must be 'compression'"):
        ServeConfig(roles={"compressor": RoleConfig(model=str(tmp_path))})


def test_text_compressor_reads_joined_child_texts(tmp_path: Path) -> None:
    # an untuned MiniLM saved as a text compressor: its output is the encoder on the joined children
    folder = save_text_compressor(load_sentence_encoder(MINILM), tmp_path / "text", MINILM, {})
    config = ServeConfig(port=0, roles={"compressor": RoleConfig(model=str(folder), kind="compression"),
                                        "embedder": RoleConfig(model=MINILM, kind="embedding")})
    with serve_in_background(config) as url:
        client = Client.from_url(url)
        compressed = client.compress("compressor", groups=GROUPS)
        expected = client.embed("embedder", [join_children(group) for group in GROUPS])
        np.testing.assert_allclose(compressed, expected, atol=1e-5)
        response = httpx.post(f"{url}/v1/compress", json={"model": "compressor", "embeddings": [[[0.1] * 384]]})
        assert response.status_code == 400 and "text compressor" in response.json()["error"]["message"]
