"""`overstory train planner_sft`: TRL SFTTrainer with a LoRA adapter on SmolLM2-135M, real SQuAD prompts."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from overstory.cli import main
from overstory.core.records import PlannerTrace, read_jsonl, write_jsonl
from overstory.models.planner import parse_plan
from overstory.models.registry import load_causal_lm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _sft(traces: Path, out: Path, *extra: str) -> int:
    return main(["train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"),
                 f"traces={traces}", f"out={out}", "train.batch_size=2", "train.max_length=384",
                 "train.save_steps=2", "train.logging_steps=1", "tracking.backend=jsonl",
                 f"tracking.dir={out / 'tracking'}", *extra])


def with_other_dataset(traces: Path, out: Path) -> tuple[Path, int]:
    """The SQuAD traces plus a copy of each under a NarrativeQA document id: the file and its SQuAD traces' count."""
    records = list(read_jsonl(traces, PlannerTrace))
    others = [replace(t, id=f"{t.id}/other", doc_id=f"narrativeqa/{t.doc_id}") for t in records]
    write_jsonl(out, [*records, *others])
    return out, len(records)


def test_sft_trains_a_lora_adapter_on_the_datasets_named_saves_and_resumes(planner_traces: Path,
                                                                           tmp_path: Path) -> None:
    out = tmp_path / "sft"
    mixed, n_squad = with_other_dataset(planner_traces, tmp_path / "mixed.jsonl")
    assert _sft(mixed, out, "train.max_steps=2", "datasets=[squad]") == 0
    final = out / "final"
    manifest = json.loads((final / "overstory.json").read_text())
    assert manifest["adapter"] and manifest["teachers"] == ["template"] and manifest["metrics"]["steps"] == 2
    # the gold-levels-only planner's filter: the NarrativeQA copies left out and counted
    assert manifest["metrics"]["n_traces_by_dataset"] == {"squad": n_squad}
    assert manifest["metrics"]["n_left_out_by_dataset"] == {"narrativeqa": n_squad}
    assert manifest["metrics"]["n_train"] + manifest["metrics"]["n_val"] == n_squad
    assert manifest["metrics"]["n_train"] > 0 and manifest["metrics"]["n_val"] > 0  # split by document
    # what `bench train` turns into tokens/s and MFU: non-padding tokens of 2 steps of 2 traces, and the adapter's
    # share of the parameters
    metrics = manifest["metrics"]
    assert 4 * 50 < metrics["tokens_seen"] <= 4 * 384 and 0 < metrics["trainable_params"] < metrics["params"] / 10
    adapter = load_file(final / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # LoRA B starts at zero: training moved it
    assert (final / "tokenizer_config.json").exists()
    history = json.loads((out / "metrics.json").read_text())["history"]
    assert all(torch.isfinite(torch.tensor(row["loss"])) for row in history if "loss" in row)

    assert _sft(mixed, out, "train.max_steps=3", "datasets=[squad]") == 0  # resumes from checkpoint-2
    assert json.loads((final / "overstory.json").read_text())["metrics"]["steps"] == 3
    steps = [row["step"] for row in json.loads((out / "metrics.json").read_text())["history"] if "loss" in row]
    assert steps[-1:] == [3]


def test_sft_adapter_learns_the_planner_format(planner_traces: Path, sft_planner: Path) -> None:
    """The session's short SFT run (tests/training/conftest.py): its loss went down, and transformers loads the
    adapter on its base model, whose greedy reply to a training prompt parses to a plan."""
    losses = [row["loss"] for row in json.loads((sft_planner / "metrics.json").read_text())["history"] if "loss" in row]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    model, tokenizer = load_causal_lm(str(sft_planner / "final"))
    assert model.peft_config  # transformers loaded the base model and attached the adapter
    trace = next(iter(read_jsonl(planner_traces, PlannerTrace)))
    prompt = tokenizer.apply_chat_template(trace.prompt, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    output = model.generate(**prompt, max_new_tokens=80, do_sample=False)
    reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert parse_plan(reply).valid, reply  # measured: the base model never writes a plan (tests/models)


def test_empty_traces_are_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no traces"):
        _sft(tmp_path / "empty.jsonl", tmp_path / "x")


def test_a_dataset_without_traces_is_a_config_error_naming_the_key(planner_traces: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    assert _sft(planner_traces, tmp_path / "sft", "datasets=[squad,qasper]", "train.max_steps=1") == 2
    assert re.search(r"config error: datasets: \['qasper'\] have no trace.*\['squad'\]", capsys.readouterr().err)
    assert not (tmp_path / "sft").exists()  # refused before loading a model or writing anything


def test_a_max_length_that_cuts_every_completion_is_a_clear_error(planner_traces: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lose their whole completion at train.max_length=16"):
        _sft(planner_traces, tmp_path / "sft", "train.max_length=16", "train.max_steps=1")
