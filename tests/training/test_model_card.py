"""Final checkpoints that travel (training/model_card.py): the model card a recipe's final save writes, and the
upload of ``push_to_hub``, tested offline up to the upload (HfApi's two calls are replaced by recorders: this
machine has no network)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard

from overstory.models.registry import SMOLLM2, load_causal_lm
from overstory.training.model_card import finish_checkpoint, name_adapter_base

MANIFEST = {"kind": "planner", "base_model": SMOLLM2, "adapter": True, "recipe": "planner_sft",
            "config": {"traces": "t.jsonl", "train": {"lr": 0.0002}}}


def _checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    data, final = tmp_path / "traces.jsonl", tmp_path / "final"
    data.write_text('{"question_id": "q1"}\n')
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    return data, final


def test_the_card_names_base_licence_data_hash_recipe_config_and_metrics(tmp_path: Path) -> None:
    data, final = _checkpoint(tmp_path)
    path = finish_checkpoint(final, MANIFEST, {"traces": str(data)}, {"train_loss": 1.25, "steps": 2,
                                                                       "history": [1, 2]}, "peft")
    card = ModelCard.load(path)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert card.data.library_name == "peft" and "planner_sft" in card.data.tags
    assert hashlib.sha256(data.read_bytes()).hexdigest() in card.text
    assert "| train_loss | 1.25 |" in card.text and "| steps | 2 |" in card.text and "history" not in card.text
    assert "lr: 0.0002" in card.text and "overstory train planner_sft --config FILE" in card.text
    assert f"`{SMOLLM2}`" in card.text  # the built-in name as the recipe was given it


def test_an_unknown_base_model_gets_no_made_up_licence(tmp_path: Path) -> None:
    data, final = _checkpoint(tmp_path)
    card = ModelCard.load(finish_checkpoint(final, {**MANIFEST, "base_model": "org/model"}, {"traces": str(data)},
                                            {}, "peft"))
    assert card.data.base_model == "org/model" and card.data.license is None
    assert "not known to overstory" in card.text


def test_push_to_hub_uploads_the_final_folder_with_its_card(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        calls.append(("upload_folder", sorted(p.name for p in Path(kwargs["folder_path"]).iterdir()), kwargs))
        return "https://huggingface.co/me/planner/commit/0"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    data, final = _checkpoint(tmp_path)
    finish_checkpoint(final, MANIFEST, {"traces": str(data)}, {"steps": 2}, "peft", push_to_hub="me/planner")
    assert calls[0] == ("create_repo", "me/planner", {"repo_type": "model", "exist_ok": True})
    name, files, kwargs = calls[1]
    assert name == "upload_folder" and files == ["README.md", "adapter_config.json"]  # the card goes up with it
    assert kwargs["folder_path"] == str(final) and kwargs["repo_id"] == "me/planner"


def test_a_failed_push_says_where_the_checkpoint_is(tmp_path: Path) -> None:
    """HF_HUB_OFFLINE=1 here: the real HfApi refuses, and the message says how to upload later."""
    data, final = _checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match=rf"push_to_hub 'me/planner' failed .*saved in {final}: upload it later"):
        finish_checkpoint(final, MANIFEST, {"traces": str(data)}, {}, "peft", push_to_hub="me/planner")
    assert (final / "README.md").exists()  # the card was written before the upload was tried


@pytest.mark.slow
def test_the_sft_recipes_final_folder_carries_its_card(sft_planner: Path) -> None:
    """The session's short planner SFT run (tests/conftest.py): its final save wrote the card."""
    final = sft_planner / "final"
    card = ModelCard.load(final / "README.md")
    manifest = json.loads((final / "overstory.json").read_text())
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.library_name == "peft"
    assert hashlib.sha256(Path(manifest["traces"]).read_bytes()).hexdigest() in card.text
    assert f"| steps | {manifest['metrics']['steps']} |" in card.text
    # the adapter names its base by hub id, not by this machine's cache folder, and still loads offline here: the
    # registry takes the exact base (the manifest's builtin: name) and puts the adapter on it
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    tuned, tokenizer = load_causal_lm(str(final))
    base, _ = load_causal_lm(SMOLLM2)
    ids = tokenizer("Which levels does this question need?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert not torch.allclose(tuned(ids).logits, base(ids).logits)  # the trained adapter is on


def test_an_adapter_names_its_base_by_hub_id_or_keeps_a_local_name(tmp_path: Path) -> None:
    """A built-in base becomes its upstream hub id, a hub id stays, a local folder (no hub id known) keeps its name;
    the adapter's other settings are untouched, and a folder without an adapter is left alone."""
    folder = tmp_path / "final"
    folder.mkdir()
    for base, named in [(SMOLLM2, "HuggingFaceTB/SmolLM2-135M-Instruct"), ("org/model", "org/model"),
                        (str(tmp_path), str(tmp_path))]:
        (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/cache/x", "r": 8}))
        name_adapter_base(folder, base)
        assert json.loads((folder / "adapter_config.json").read_text()) == {"base_model_name_or_path": named, "r": 8}
    name_adapter_base(tmp_path, SMOLLM2)
    assert not (tmp_path / "adapter_config.json").exists()
