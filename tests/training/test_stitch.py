"""STITCH: routing through all three branches (scripted stand-in policy), and real steps on SmolLM2-135M."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import PlannerTrace, write_jsonl
from overstory.models.planner import plan_json, planner_messages
from overstory.training import checkpoint_state, stitch
from overstory.training.stitch import (
    StitchConfig,
    StitchSettings,
    hint_for,
    hint_length,
    hint_traces,
    names_label,
    route,
)

ROOT = Path(__file__).resolve().parents[2]


def _row(example_id: str, low: str, high: str) -> dict:
    return {"example_id": example_id, "prompt": planner_messages(f"question {example_id}?", "Title: T\nText."),
            "level_min": low, "level_max": high}


def _trace(example_id: str, low: str, high: str, reasoning: str = "Reason one. Reason two.",
           teacher: str = "t") -> PlannerTrace:
    return PlannerTrace(f"{example_id}/{teacher}", example_id, "d", teacher, [], f"{reasoning}\n{plan_json(low, high)}",
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

    settings = StitchSettings(num_generations=3)
    routing = route(rows, stand_in_policy, traces, success_rate=0.75, settings=settings,
                    count_tokens=lambda text: len(text.split()), limit=50)
    assert [r["example_id"] for r in routing.rl] == ["q-easy", "q-hint"]
    assert "Hint: Reason one." in routing.rl[1]["prompt"][-1]["content"]  # reinforced with the hinted prompt
    assert "Reason two" not in routing.rl[1]["prompt"][-1]["content"]  # success 0.75 -> hint of 1 of 2 sentences
    assert sorted(r["example_id"] for r in routing.imitation) == ["q-hard", "q-long"]
    assert (routing.solved_plain, routing.solved_hinted, routing.unsolved) == (1, 1, 2)
    assert (routing.hinted, routing.hint_cuts, routing.hint_leaks, routing.no_trace) == (3, 0, 0, 0)
    assert len(seen_prompts) == 4 + 3  # every question once, the three unsolved again with hints


def test_hints_never_reveal_the_concluding_sentence() -> None:
    """Whatever the success rate and hint mode, the hint stops before a trace's last sentence (where the template
    teacher names the chunk sizes), and a one-sentence trace gives no hint at all."""
    for settings in (StitchSettings(), StitchSettings(hint="fixed", fixed_hint_fraction=0.99)):
        for n in range(1, 8):
            for rate in (0.0, 0.1, 0.5, 0.9, 1.0):
                assert hint_length(n, rate, settings) <= n - 1
    rows = [_row("q-one", "sentence", "sentence")]
    reply = f"Just this.\n{plan_json('sentence', 'sentence')}"
    one_sentence = {"q-one": PlannerTrace("q-one/t", "q-one", "d", "t", [], reply,
                                          {"level_min": "sentence", "level_max": "sentence"}, 10)}
    prompts = []
    routing = route(rows, lambda p, n: prompts.extend(p) or [["no"] * n for _ in p], one_sentence, 0.0,
                    StitchSettings(num_generations=2), count_tokens=lambda text: 1, limit=10)
    assert [r["example_id"] for r in routing.imitation] == ["q-one"] and len(prompts) == 1  # no hinted rollout


def _never_solves(prompts: list, n: int) -> list[list[str]]:
    """A stand-in policy (not a model) that answers every prompt with the same wrong plan."""
    return [[plan_json("document", "document")] * n for _ in prompts]


def test_hints_stop_before_a_sentence_naming_the_label_and_traceless_questions_are_counted() -> None:
    """Traces as an LLM teacher that is told the label may write them: the label named in the first sentence (no hint
    is left: the question goes to imitation) or the second (the hint is the first sentence); a question without a
    trace goes to neither buffer. Both cuts and the traceless question are counted; no hinted prompt names a level."""
    rows = [_row("q-first", "sentence", "paragraph"), _row("q-second", "paragraph", "section"),
            _row("q-none", "sentence", "sentence")]
    traces = {"q-first": _trace("q-first", "sentence", "paragraph", "One Paragraph holds it. It is a date. Done."),
              "q-second": _trace("q-second", "paragraph", "section", "It asks for a place. The sections describe it. "
                                                                     "More follows. So that is it.")}
    prompts = []
    routing = route(rows, lambda p, n: prompts.extend(p) or _never_solves(p, n), traces, 0.0,
                    StitchSettings(num_generations=2), count_tokens=lambda text: 1, limit=10)
    assert (routing.hint_cuts, routing.hint_leaks, routing.no_trace, routing.hinted) == (2, 0, 1, 1)
    assert sorted(r["example_id"] for r in routing.imitation) == ["q-first", "q-second"] and not routing.rl
    assert prompts[-1][-1]["content"].endswith("\n\nHint: It asks for a place.")


def test_every_hinted_prompt_is_checked_for_a_level_of_its_label(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leak check reads the hinted prompts themselves: a hint extraction that let the label through is counted."""
    monkeypatch.setattr(stitch, "hint_for", lambda *args: ("The evidence is in a few sentences.", False))
    rows = [_row("q-a", "sentence", "paragraph"), _row("q-b", "section", "document")]
    traces = {r["example_id"]: _trace(r["example_id"], r["level_min"], r["level_max"]) for r in rows}
    routing = route(rows, _never_solves, traces, 0.0, StitchSettings(num_generations=2), lambda text: 1, limit=10)
    assert (routing.hinted, routing.hint_leaks) == (2, 1)  # "sentences" names q-a's level, none of q-b's


def test_the_hint_teacher_must_be_named_when_a_trace_file_holds_several(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    write_jsonl(path, [_trace("q1", "sentence", "sentence", teacher="template"),
                       _trace("q1", "sentence", "sentence", teacher="smollm2-concise"),
                       _trace("q2", "paragraph", "section", teacher="template")])
    with pytest.raises(ConfigError, match=r"several teachers \(smollm2-concise, template\): set traces_teacher"):
        hint_traces(path, "")
    picked = hint_traces(path, "template")
    assert sorted(picked) == ["q1", "q2"] and {t.teacher for t in picked.values()} == {"template"}
    assert [t.teacher for t in hint_traces(path, "smollm2-concise").values()] == ["smollm2-concise"]
    with pytest.raises(ConfigError, match=r"'qwen' wrote no trace .* \(its teachers: smollm2-concise, template\)"):
        hint_traces(path, "qwen")
    write_jsonl(tmp_path / "one.jsonl", [_trace("q1", "sentence", "sentence", teacher="template")])
    assert list(hint_traces(tmp_path / "one.jsonl", "")) == ["q1"]  # one teacher: no name needed


@pytest.mark.parametrize("key", ["grpo.max_steps", "grpo.batch_size", "grpo.grad_accum", "grpo.steps_per_generation",
                                 "grpo.save_steps", "grpo.num_generations", "grpo.max_completion_length",
                                 "stitch.max_completion_tokens", "stitch.sft_steps"])
def test_keys_stitch_would_not_use_are_refused(key: str) -> None:
    """STITCH sets each GRPO update's shape and schedule itself, and has one completion-length limit
    (rewards.max_completion_tokens): the keys that would parse and do nothing are refused by name."""
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(StitchConfig, ROOT / "configs/train/stitch.yaml", [f"{key}=4"])


def _stitch_args(labels: Path, sft_planner: Path, traces: Path, out: Path) -> list[str]:
    return ["train", "stitch", "--config", str(ROOT / "configs/train/stitch.yaml"), f"data.labels={labels}",
            "data.metadata_tokens=96", "data.val_fraction=0", f"model={sft_planner / 'final'}", f"traces={traces}",
            "traces_teacher=template", f"out={out}", "stitch.questions_per_step=2", "stitch.num_generations=2",
            "stitch.rollout_temperature=0.05", "rewards.max_completion_tokens=72", "stitch.imitation_threshold=1",
            "tracking.backend=jsonl", f"tracking.dir={out / 'tracking'}"]


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "stitch_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_stitch_steps_on_the_real_model_update_inject_sft_and_refuse_other_settings(
        stitch_labels: Path, planner_traces: Path, sft_planner: Path, tmp_path: Path) -> None:
    """From a short real SFT adapter that writes the planner's format, on two questions it solves one of (so GRPO runs
    on the solved one, and the other goes to imitation: SFT is injected, imitation_threshold=1)."""
    out = tmp_path / "stitch"
    args = _stitch_args(stitch_labels, sft_planner, planner_traces, out)
    before = load_file(sft_planner / "final" / "adapter_model.safetensors")
    # one step over both questions: near-greedy rollouts solve one (GRPO update), the other goes to SFT; with
    # R_QA on, through an embedded stack (built-in SmolLM2 generator, MiniLM embedder) the job starts for itself
    assert main([*args, "stitch.steps=1", "rewards.qa=1.0", "serve.port=0"]) == 0
    log = _log(out)
    assert [r["step"] for r in log] == [1]
    for record in log:
        assert {"solve_none_ratio", "hinted_solve_ratio", "rl_buffer", "imitation_buffer", "format_valid",
                "format_valid_strict", "grpo_updates", "no_trace", "hint_cuts"} <= set(record)
        assert 0 <= record["format_valid_strict"] <= record["format_valid"] <= 1
        assert record["hint_leaks"] == 0 and record["no_trace"] == 0  # every question has a template trace
    assert any(r["format_valid"] > 0 for r in log)  # the SFT adapter writes plans
    updated = [r for r in log if r["rl_buffer"] > 0]
    assert updated, log  # some question was solved, so a GRPO update ran
    for record in updated:
        assert record["grpo_updates"] == 1 and isinstance(record["reward"], float)
        assert {"format_reward", "qa_reward"} <= set(record["rewards"]) and 0 <= record["rewards"]["qa_reward"] <= 1
    # a real gradient step on the LoRA: the 2 rollouts of the prompt differ (sampled at grpo.temperature 1.0), and so do
    # their length, cost and QA rewards (an update whose groups were all flat has a zero gradient and, without weight
    # decay, moves nothing)
    assert any(r["grpo_grad_norm"] > 0 and r["grpo_weight_change"] > 0 for r in updated), updated
    injected = [r for r in log if r["sft_injection"]]
    assert injected and all(r["sft_examples"] >= 1 and r["sft_optimizer_steps"] >= 1 for r in injected)
    after = load_file(out / "final" / "adapter_model.safetensors")
    assert set(before) == set(after) and any((before[k] != after[k]).any() for k in before)
    assert json.loads((out / "final" / "overstory.json").read_text())["recipe"] == "stitch"
    qa = json.loads((out / "metrics.json").read_text())["qa_rewards"]  # the embedded stack answered every plan
    assert qa["missing"] == 0 and qa["given"] >= 2

    # a resume with other settings (another hint mode, R_QA off) is refused by name; only stitch.steps may grow
    assert main([*args, "stitch.steps=2", "stitch.hint=fixed"]) == 2
    assert [r["step"] for r in _log(out)] == [1]


@pytest.mark.slow
def test_a_kill_between_the_adapter_and_the_state_applies_no_step_twice(
        planner_labels: Path, planner_traces: Path, sft_planner: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 2 is killed after its adapter and optimizers are written and before its state: the rerun resumes after
    step 1 (the folder a rerun reads never holds step 2's adapter beside step 1's state) and applies step 2 once,
    giving exactly the adapter the killed attempt had computed (the RNG state is saved with the step). A length limit
    no plan fits in (4 tokens) leaves every question unsolved, so each step injects SFT and moves the adapter."""
    out = tmp_path / "stitch"
    args = [*_stitch_args(planner_labels, sft_planner, planner_traces, out), "stitch.questions_per_step=1",
            "rewards.max_completion_tokens=4"]
    assert main([*args, "stitch.steps=1"]) == 0
    step_1 = load_file(out / "last" / "adapter_model.safetensors")

    def killed(*_args, **_kwargs):
        raise KeyboardInterrupt("killed between the adapter and the state")

    monkeypatch.setattr(checkpoint_state, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "stitch.steps=2"])
    monkeypatch.undo()
    killed_step_2 = load_file(out / "last.tmp" / "adapter_model.safetensors")  # what the kill left staged
    assert any((step_1[k] != killed_step_2[k]).any() for k in step_1)  # step 2 changes the adapter (SFT injection)
    assert json.loads((out / "last" / "stitch_state.json").read_text())["step"] == 1
    assert all((step_1[k] == v).all() for k, v in load_file(out / "last" / "adapter_model.safetensors").items())
    assert [r["step"] for r in _log(out)] == [1]

    assert main([*args, "stitch.steps=2"]) == 0
    assert [r["step"] for r in _log(out)] == [1, 2] and all(r["sft_injection"] for r in _log(out))
    resumed = load_file(out / "last" / "adapter_model.safetensors")
    assert all(torch.equal(resumed[k], killed_step_2[k]) for k in resumed)  # step 2 applied once, from step 1
    assert not (out / "last.tmp").exists() and not (out / "last.old").exists()


@pytest.mark.slow
def test_hints_from_real_teacher_traces_never_name_the_label(planner_labels: Path, tmp_path: Path) -> None:
    """The traces job's own pool on real questions: the template teacher and SmolLM2 told the label (the concise
    style of configs/data/traces.yaml). Every hint STITCH would give, at every success rate and in both modes, is
    free of the label's level names; a file of both teachers needs traces_teacher, and names them."""
    traces = tmp_path / "traces.jsonl"
    assert main(["data", "traces", "--config", str(ROOT / "configs/data/traces.yaml"), f"labels={planner_labels}",
                 f"out={traces}", "limit=4", "metadata_tokens=96", "concurrency=1", "tracking.backend=none",
                 "teachers={template: {kind: template}, smollm2-concise: {kind: llm, style: concise}}"]) == 0
    with pytest.raises(ConfigError, match=r"several teachers \(smollm2-concise, template\)"):
        hint_traces(traces, "")
    cuts = 0
    for teacher in ("template", "smollm2-concise"):
        for trace in hint_traces(traces, teacher).values():
            row = trace.label
            for settings in (StitchSettings(), StitchSettings(hint="fixed", fixed_hint_fraction=0.9)):
                for rate in (0.0, 0.25, 0.5, 1.0):
                    hint, cut = hint_for(trace, row, rate, settings)
                    assert not names_label(hint, row["level_min"], row["level_max"]), (teacher, trace.completion)
                    cuts += cut
    # measured: SmolLM2 names the label early ("the document contains sentences ..."), so real hints are cut
    assert cuts > 0


