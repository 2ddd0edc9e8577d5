"""The planner's data and evaluation jobs with the built-in teacher (Qwen2.5-Coder-1.5B-Instruct) serving them, on
real SQuAD slices: pseudo-labels with the teacher as the backbone, planner traces from it through the structured
schema, and eval planner's fixed-range references with it as the generator (on the suite's planner labels: real
questions, ranges chosen in tests/conftest.py), resumed from its kept answers.

One embedded teacher stack (configs/serve/cpu-teacher.yaml) serves the module; the jobs reach it by ``server_url``
and record the model it reports. The slices are the smallest that exercise each path: every call decodes at a few
tokens a second on these cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import load_config
from overstory.core.records import PlannerTrace, PseudoLabel, read_jsonl
from overstory.models.planner import plan_json
from overstory.models.registry import QWEN_CODER
from overstory.serving.config import ServeConfig
from overstory.serving.launch import serve_in_background
from tests.conftest import ROOT, SQUAD

pytestmark = pytest.mark.slow  # and `alone` (tests/conftest.py): a 6 GB teacher beside nothing else


@pytest.fixture(scope="module")
def teacher_url() -> Iterator[str]:
    config = load_config(ServeConfig, ROOT / "configs/serve/cpu-teacher.yaml", ["port=0"])
    with serve_in_background(config, timeout_s=600) as url:
        yield url


@pytest.fixture(scope="module")
def teacher_labels(teacher_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 2 SQuAD questions (of two articles), one attempt each from the top 3 chunks, with the teacher as the
    backbone."""
    out = tmp_path_factory.mktemp("labels") / "squad.jsonl"
    assert main(["data", "pseudo-labels", "--config", str(ROOT / "configs/data/pseudo_labels.yaml"), "--out", str(out),
                 f"corpus.path={SQUAD}", "limit=2", "max_attempts=1", "k=3", "concurrency=2",
                 f"server_url={teacher_url}", "request_timeout_s=600", "tracking.backend=none"]) == 0
    return out


def test_pseudo_labels_with_the_teacher_as_backbone(teacher_labels: Path) -> None:
    """Every label names the teacher as its backbone; the teacher answers from the first retrieval, and the labels'
    summary measures both the method's ranges and the answer-grounded rule's against SQuAD's gold levels."""
    labels = list(read_jsonl(teacher_labels, PseudoLabel))
    assert len(labels) == 2 and {x.backbone for x in labels} == {QWEN_CODER}
    assert any(x.correct for x in labels), [(x.question, x.answer, x.answers) for x in labels]
    summary = json.loads(teacher_labels.with_suffix(".summary.json").read_text())
    assert summary["backbones"] == [QWEN_CODER] and summary["labelled"] == sum(x.correct for x in labels)
    assert summary["agreement"]["method"]["gold"] == 2 and summary["grounding"]["grounded"] >= 1


def test_traces_from_the_teacher_through_the_structured_schema(teacher_labels: Path, tmp_path: Path,
                                                                teacher_url: str, capsys) -> None:
    """The teacher justifies each label through TRACE_SCHEMA; its kept traces name the model that wrote them and end
    in exactly the label, and the yield per teacher is printed beside the template teacher's."""
    out = tmp_path / "traces.jsonl"
    teachers = "{template: {kind: template}, qwen: {kind: llm, role: generator, style: concise, temperature: 0.0}}"
    assert main(["data", "traces", "--config", str(ROOT / "configs/data/traces.yaml"), f"labels={teacher_labels}",
                 f"out={out}", f"teachers={teachers}", f"server_url={teacher_url}", "concurrency=2",
                 "tracking.backend=none"]) == 0
    labels = {x.id: x for x in read_jsonl(teacher_labels, PseudoLabel) if x.correct}
    traces = list(read_jsonl(out, PlannerTrace))
    by_teacher = {name: [t for t in traces if t.teacher == name] for name in ("template", "qwen")}
    assert len(by_teacher["template"]) == len(labels)  # the template teacher always yields
    assert by_teacher["qwen"], capsys.readouterr().out  # the teacher's replies parse to the label
    for trace in by_teacher["qwen"]:
        label = labels[trace.question_id]
        assert trace.served_model == QWEN_CODER
        assert trace.completion.rstrip().endswith(plan_json(label.level_min, label.level_max))
    assert "qwen" in capsys.readouterr().out


def test_eval_planner_fixed_ranges_with_the_teacher_resume_from_kept_answers(planner_labels: Path, tmp_path: Path,
                                                                           teacher_url: str, capsys) -> None:
    """The fixed-range references on real SQuAD questions (2 of the held-out article, the best range chosen on 1
    training question), answered by the teacher (named in metrics.json); a rerun reads every answer back and asks
    none, and a rerun with another k is refused by name before anything is asked."""
    out = tmp_path / "eval"

    def evaluate(*extra: str) -> int:
        return main(["eval", "planner", "--config", str(ROOT / "configs/eval/planner.yaml"), "--data",
                     str(planner_labels), "--out", str(out), "checkpoint=builtin:smollm2-135m-instruct",
                     "val_fraction=0.2", "limit=2", "metadata_tokens=64", "max_new_tokens=48", "k=2",
                     "fixed_ranges=[sentence..sentence, paragraph..section]", "fixed_range_selection=1",
                     f"server_url={teacher_url}", "concurrency=3", "request_timeout_s=600", "tracking.backend=none",
                     *extra])

    assert evaluate() == 0
    first = json.loads((out / "metrics.json").read_text())
    assert first["served"]["generator"] == QWEN_CODER and first["n_questions"] == 2
    ranges = first["fixed_ranges"]["ranges"]
    assert set(ranges) == {"sentence..sentence", "paragraph..section"} and all(r["n"] == 2 for r in ranges.values())
    assert ranges["sentence..sentence"]["tokens_read"] < ranges["paragraph..section"]["tokens_read"]
    assert 0 < ranges["paragraph..section"]["tokens_given"] <= ranges["paragraph..section"]["tokens_read"]
    assert first["fixed_ranges"]["best"]["selection_questions"] == 1
    # every (question, range) once: the 2 held-out and the 1 selection question under both ranges, and the plans'
    asked = first["answers"]["asked"]
    assert 6 <= asked <= 8 and first["answers"]["resumed"] == 0

    assert evaluate() == 0
    again = json.loads((out / "metrics.json").read_text())
    assert again["answers"] == {"asked": 0, "resumed": asked, "refreshed": 0, "refreshed_retrieval_differs": 0}
    assert again["fixed_ranges"] == first["fixed_ranges"]

    assert evaluate("k=3") != 0
    assert "qa_answers.jsonl was made with other settings (k differ" in capsys.readouterr().err
