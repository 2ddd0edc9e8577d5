"""The set compressor: shapes and masks, starts at the mean of its children, learns, saves and loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from overstory.models.compressor import (
    SetCompressor,
    SetCompressorConfig,
    load_compressor,
    pad_children,
    save_checkpoint,
)


@pytest.fixture
def model() -> SetCompressor:
    torch.manual_seed(0)
    return SetCompressor(SetCompressorConfig(embedding_dim=32, num_heads=4, ffn_dim=64, dropout=0.0)).eval()


def _groups(sizes: list[int], dim: int = 32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(m, dim, generator=generator) for m in sizes]


def test_untrained_compressor_is_the_masked_mean(model: SetCompressor) -> None:
    groups = _groups([1, 3, 200])  # one child, a few, hundreds
    batch, mask = pad_children(groups)
    assert batch.shape == (3, 200, 32) and mask.sum(1).tolist() == [1, 3, 200]
    out = model(batch, mask)
    torch.testing.assert_close(out, torch.stack([g.mean(0) for g in groups]), atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_outputs(model: SetCompressor) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a "trained" model, so attention is not uniform
    groups = _groups([2, 5])
    alone = torch.cat([model(*pad_children([g])) for g in groups])
    together = model(*pad_children(groups))
    torch.testing.assert_close(alone, together, atol=1e-5, rtol=1e-5)


def test_learns_a_target_that_is_not_the_mean() -> None:
    torch.manual_seed(0)
    model = SetCompressor(SetCompressorConfig(embedding_dim=16, num_heads=2, ffn_dim=32, dropout=0.0))
    groups = _groups([4] * 64, dim=16)
    batch, mask = pad_children(groups)
    target = torch.stack([g.max(0).values for g in groups])  # max-pooling: needs attention, not a mean
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(150):
        loss = torch.nn.functional.mse_loss(model(batch, mask), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_save_load_round_trip(model: SetCompressor, tmp_path: Path) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch, mask = pad_children(_groups([3, 7]))
    folder = save_checkpoint(model, tmp_path / "ckpt", {"metrics": {"val_mse": 0.1}})
    assert {"config.json", "model.safetensors", "overstory.json"} <= {p.name for p in folder.iterdir()}
    loaded = load_compressor(folder, embedding_dim=32)
    torch.testing.assert_close(loaded(batch, mask), model(batch, mask))


def test_errors(model: SetCompressor, tmp_path: Path) -> None:
    save_checkpoint(model, tmp_path / "ckpt", {})
    with pytest.raises(ValueError, match="trained on 32-dim embeddings"):
        load_compressor(tmp_path / "ckpt", embedding_dim=384)
    with pytest.raises(FileNotFoundError, match="not a compressor checkpoint"):
        load_compressor(tmp_path)
    with pytest.raises(ValueError, match=r"\[batch, children, 32\]"):
        model(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="at least one child"):
        model(torch.zeros(1, 2, 32), torch.zeros(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="not divisible"):
        SetCompressorConfig(embedding_dim=30, num_heads=4)
