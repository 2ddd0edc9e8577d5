"""STITCH: routing through all three branches (scripted stand-in policy), and real steps on SmolLM2-135M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from overstory.cli import main
from overstory.data_pipeline.formats import PlannerTrace
from overstory.models.planner import plan_json, planner_messages
from overstory.training.stitch import StitchSettings, route

ROOT = Path(__file__).resolve().parents[2]


def _row(example_id: str, low: str, high: str) -> dict:
    return {"example_id": example_id, "prompt": planner_messages(f"question {example_id}?", "Title: T\nText."),
            "level_min": low, "level_max": high}


def _trace(example_id: str, low: str, high: str) -> PlannerTrace:
    return PlannerTrace(f"{example_id}/t", example_id, "d", "t", [], f"Reason one. Reason two.\n{plan_json(low, high)}",
                        {"level_min": low, "level_max": high}, 20)


def test_route_sends_questions_through_all_three_branches() -> None:
    """A scripted stand-in policy (not a model: it forces each branch deterministically): q-easy is solved
    outright, q-hint only once the hint is in the prompt, q-hard never; q-long is right but too long."""
    rows = [_row("q-easy", "sentence", "paragraph"), _row("q-hint", "paragraph", "section"),
            _row("q-hard", "sentence", "sentence"), _row("q-long", "sentence", "sentence")]
    traces = {r["example_id"]: _trace(r["example_id"], r["level_min"], r["level_max"]) for r in rows}
    seen_prompts = []

    def stand_in_policy(prompts: list, n: int) -> list[list[str]]:
        replies = []
        for prompt in prompts:
            seen_prompts.append(prompt[-1]["content"])
            text = prompt[-1]["content"]
            if "q-easy" in text or ("q-hint" in text and "Hint: Reason one." in text):
                replies.append(["no plan"] * (n - 1) + [plan_json(*("sentence", "paragraph") if "q-easy" in text
                                                                  else ("paragraph", "section"))])
            elif "q-long" in text:
                replies.append(["word " * 200 + plan_json("sentence", "sentence")] * n)
            else:
                replies.append([plan_json("document", "document")] * n)
        return replies

    settings = StitchSettings(num_generations=3, max_completion_tokens=50)
    routing = route(rows, stand_in_policy, traces, success_rate=0.75, settings=settings,
                    count_tokens=lambda text: len(text.split()))
    assert [r["example_id"] for r in routing.rl] == ["q-easy", "q-hint"]
    assert "Hint: Reason one." in routing.rl[1]["prompt"][-1]["content"]  # reinforced with the hinted prompt
    assert "Reason two" not in routing.rl[1]["prompt"][-1]["content"]  # success 0.75 -> hint of 1 of 2 sentences
    assert sorted(r["example_id"] for r in routing.imitation) == ["q-hard", "q-long"]
    assert (routing.solved_plain, routing.solved_hinted, routing.unsolved) == (1, 1, 2)
    assert len(seen_prompts) == 4 + 3  # every question once, the three unsolved again with hints


@pytest.mark.slow
def test_stitch_steps_on_the_real_model_inject_sft_and_resume(planner_labels: Path, planner_traces: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "stitch"
    args = ["train", "stitch", "--config", str(ROOT / "configs/train/stitch.yaml"), f"data.labels={planner_labels}",
            "data.metadata_tokens=48",
            f"traces={planner_traces}", f"out={out}", "stitch.questions_per_step=2", "stitch.num_generations=2",
            "stitch.max_completion_tokens=24", "stitch.imitation_threshold=2", "grpo.num_generations=2",
            "grpo.batch_size=2", "grpo.max_completion_length=24", "tracking.backend=jsonl",
            f"tracking.dir={out / 'tracking'}"]
    assert main([*args, "stitch.steps=2"]) == 0
    log = [json.loads(line) for line in (out / "stitch_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2]
    for record in log:
        assert {"solve_none_ratio", "hinted_solve_ratio", "rl_buffer", "imitation_buffer"} <= set(record)
    # measured: the untrained model solves none, even with hints, so both steps inject SFT
    assert any(r["sft_injection"] for r in log)
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    assert json.loads((out / "final" / "overstory.json").read_text())["recipe"] == "stitch"

    assert main([*args, "stitch.steps=3"]) == 0  # resumes after step 2
    assert [json.loads(line)["step"] for line in (out / "stitch_log.jsonl").read_text().splitlines()] == [1, 2, 3]
