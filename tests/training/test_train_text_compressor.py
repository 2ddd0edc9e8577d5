"""`overstory train text_compressor` (design b): MiniLM fine-tuned on real HotpotQA sentences -> summary embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import ModelCard
from safetensors.numpy import load_file

from overstory.cli import main
from overstory.models.registry import resolve
from overstory.models.text_compressor import checkpoint_kind, load_text_compressor
from overstory.training.callbacks import TrainingDiverged

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _train(data: Path, out: Path, *extra: str) -> int:
    return main(["train", "text_compressor", "--config", str(ROOT / "configs/train/text_compressor.yaml"),
                 f"data={data}", f"out={out}", "train.batch_size=8", "train.logging_steps=1",
                 "tracking.backend=jsonl", f"tracking.dir={out / 'tracking'}", *extra])


def test_fine_tuning_lowers_validation_loss_changes_weights_and_resumes(summaries: Path, tmp_path: Path) -> None:
    out = tmp_path / "text"
    assert _train(summaries, out, "train.epochs=3", "train.lr=1e-4") == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["improved"] and metrics["best_val_mse"] < metrics["initial_val_mse"]
    assert [row["epoch"] for row in metrics["history"]] == [1.0, 2.0, 3.0]
    assert checkpoint_kind(out / "best") == "text-compressor"
    card = ModelCard.load(out / "best" / "README.md")  # the checkpoint travels with its card
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2" and card.data.library_name == \
        "sentence-transformers"
    model = load_text_compressor(out / "best", embedding_dim=384)
    assert model.encode(["A sentence.\nAnother one."]).shape == (1, 384)
    base = load_file(next(Path(resolve("builtin:all-minilm-l6-v2")).rglob("model.safetensors")))
    tuned = load_file(next((out / "best").rglob("model.safetensors")))
    assert any(not np.array_equal(base[k], tuned[k]) for k in base if k in tuned)
    tracked = (next((out / "tracking").glob("*/metrics.jsonl"))).read_text().splitlines()
    assert any("eval_loss" in json.loads(line) for line in tracked)
    with pytest.raises(ValueError, match="384-dim"):
        load_text_compressor(out / "best", embedding_dim=768)

    assert _train(summaries, out, "train.epochs=4", "train.lr=1e-4") == 0  # resumes after epoch 3
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert [row["epoch"] for row in history] == [1.0, 2.0, 3.0, 4.0]


def test_missing_hierarchy_is_a_clear_error(summaries: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="children's texts"):
        _train(summaries, tmp_path / "t", f"hierarchies={tmp_path / 'nope.jsonl'}")


def test_non_finite_loss_stops_with_a_clear_error(summaries: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainingDiverged, match="non-finite"):
        _train(summaries, tmp_path / "nan", "train.epochs=1", "train.lr=1e10")
    assert not (tmp_path / "nan" / "best").exists()
