"""`overstory data traces` on real SQuAD questions: the rule-based teacher and SmolLM2 teachers, failures, resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi import FastAPI

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.core.records import LEVELS, PlannerTrace, PseudoLabel, read_jsonl, write_jsonl
from overstory.data_pipeline.corpora import load_corpus
from overstory.data_pipeline.hierarchy import save_hierarchies, stored_hierarchy_path
from overstory.data_pipeline.pseudo_labels import single_document_questions
from overstory.data_pipeline.traces import TracesConfig, template_trace
from overstory.models.planner import normalise_level, parse_plan
from overstory.serving.launch import serve_in_background
from overstory.training.stitch import StitchSettings, hint_length, trace_sentences

ROOT = Path(__file__).resolve().parents[2]
SQUAD = ROOT / "data/squad/dev-v2.0-articles.json"


@pytest.fixture()
def labels(tmp_path: Path, squad_chunks: list) -> Path:
    """Pseudo-labels for three real questions (the job's input; the labels themselves are chosen here)."""
    _, questions = load_corpus("squad", SQUAD)
    ranges = [("sentence", "paragraph"), ("paragraph", "section"), ("sentence", "sentence")]
    records = [PseudoLabel(q.id, doc_id, q.question, q.answers, low, high, True, 1, [], [], q.answers[0],
                           "builtin:smollm2-135m-instruct", "contains")
               for (q, doc_id), (low, high) in zip(single_document_questions(questions), ranges)]
    records.append(PseudoLabel("unsolved", records[0].doc_id, "?", ["x"], None, None, False, 3, [], [], "", "", ""))
    write_jsonl(tmp_path / "labels.jsonl", records)
    save_hierarchies(stored_hierarchy_path(tmp_path / "labels.jsonl"), squad_chunks)  # as the labelling job does
    return tmp_path / "labels.jsonl"


def _traces(labels: Path, out: Path, *extra: str) -> int:
    return main(["data", "traces", "--config", str(ROOT / "configs/data/traces.yaml"), f"labels={labels}",
                 "--out", str(out), "metadata_tokens=64", "tracking.backend=none", *extra])


@pytest.mark.slow
@pytest.mark.usefixtures("quick_retries")  # the offline teacher's retries
def test_teacher_pool_keeps_matching_traces_records_failures_and_resumes(labels: Path, tmp_path: Path) -> None:
    out = tmp_path / "traces.jsonl"
    teachers = ("teachers={template: {kind: template}, smollm2: {kind: llm, style: concise, max_tokens: 48}, "
                "offline: {kind: llm, server_url: 'http://127.0.0.1:9'}}")
    assert _traces(labels, out, teachers) == 1  # the offline teacher's three requests failed: counted, exit 1
    traces = list(read_jsonl(out, PlannerTrace))
    kept = {t.teacher for t in traces}
    assert "template" in kept and "offline" not in kept
    assert sum(t.teacher == "template" for t in traces) == 3  # the unsolved question gets no trace
    for trace in traces:
        plan = parse_plan(trace.completion)
        assert plan.levels == (trace.label["level_min"], trace.label["level_max"]) and trace.n_tokens <= 128
        # the student's prompt: the planner's system prompt, the document's beginning, the question
        assert trace.prompt[0]["role"] == "system" and trace.prompt[1]["content"].startswith("Document (beginning):")
    rejected = [json.loads(line) for line in out.with_name("traces.rejected.jsonl").read_text().splitlines()]
    # measured: SmolLM2-135M never writes the JSON plan, so its traces are rejected with the raw text kept
    assert all(f["raw"] and f["id"].endswith("/smollm2") for f in rejected)
    assert len(rejected) + sum(t.teacher == "smollm2" for t in traces) == 3
    failed = [json.loads(line) for line in out.with_name("traces.failures.jsonl").read_text().splitlines()]
    assert sorted(f["id"].rsplit("/", 1)[1] for f in failed) == ["offline"] * 3
    settings = json.loads(out.with_name("traces.settings.json").read_text())
    assert settings["served"]["teacher/smollm2"] == "builtin:smollm2-135m-instruct"

    # a rerun asks only the failed teacher again (nothing else is regenerated); other settings are refused
    lines = out.read_text()
    assert _traces(labels, out, teachers, "max_failure_share=1") == 0
    assert out.read_text() == lines and len(out.with_name("traces.failures.jsonl").read_text().splitlines()) == 3
    assert _traces(labels, out, teachers, "max_trace_tokens=64") == 2


@pytest.mark.slow
def _labelled_teacher(model: str) -> FastAPI:
    """Stand-in for a teacher's server that reports ``model`` behind its generator and answers with the label the
    instruction gives: a real tiny model does not write label-matching traces (SmolLM2's are rejected, above), and a
    kept LLM trace is what is under test."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "generator", "object": "model", "root": model}]}

    @app.post("/v1/chat/completions")
    def chat(payload: dict) -> dict:
        low, high = re.search(r"smallest_chunk_size = (\w+) and largest_chunk_size = (\w+)",
                              payload["messages"][-1]["content"]).groups()
        reply = json.dumps({"reasoning": "The answer sits in one place.", "smallest_chunk_size": low,
                            "largest_chunk_size": high})
        return {"id": "x", "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}}

    return app


def test_each_trace_names_the_model_its_teacher_served(labels: Path, tmp_path: Path) -> None:
    out = tmp_path / "traces.jsonl"
    with serve_in_background(_labelled_teacher("teacher-7b")) as url:
        teachers = f"teachers={{template: {{kind: template}}, big: {{kind: llm, server_url: '{url}'}}}}"
        assert _traces(labels, out, teachers, "rewrite=false") == 0
    served = {(t.teacher, t.served_model) for t in read_jsonl(out, PlannerTrace)}
    assert served == {("big", "teacher-7b"), ("template", "")}
    assert json.loads(out.with_name("traces.settings.json").read_text())["served"] == {"teacher/big": "teacher-7b"}
    # a file written before the field existed still reads, as served by an unnamed model
    old = {k: v for k, v in json.loads(out.read_text().splitlines()[0]).items() if k != "served_model"}
    write_jsonl(tmp_path / "old.jsonl", [old])
    assert next(read_jsonl(tmp_path / "old.jsonl", PlannerTrace)).served_model == ""


def test_empty_pool_and_bad_roles_are_config_errors(labels: Path) -> None:
    with pytest.raises(ConfigError, match="pool is empty"):
        load_config(TracesConfig, ROOT / "configs/data/traces.yaml", ["teachers={}"])
    with pytest.raises(ConfigError, match="not a chat role"):
        load_config(TracesConfig, ROOT / "configs/data/traces.yaml", ["teachers={t: {role: embedder}}"])


def _names_a_level(text: str) -> set[str]:
    """The levels a text names, in any spelling the planner's parser accepts (plurals, abbreviations, 'article')."""
    return {normalise_level(word) for word in re.findall(r"[A-Za-z-]+", text)} - {None}


def test_template_traces_name_the_label_only_in_their_last_sentence() -> None:
    """Every label the planner can have, on real SQuAD questions of every wh-word: the first n-1 sentences of the
    template trace name no level (so a hint reveals nothing of the label), the last one names the label's."""
    _, questions = load_corpus("squad", SQUAD)
    sample = [q.question for q in questions[:40]] + ["", "Name the river.", "How many dukes were there?"]
    labels = [(low, high) for i, low in enumerate(LEVELS) for high in LEVELS[i:]]
    for question in sample:
        for low, high in labels:
            trace = template_trace(low, high, question)
            assert parse_plan(trace).levels == (low, high) and not parse_plan(trace).swapped
            sentences = trace_sentences(trace)
            assert len(sentences) == 3, sentences
            for sentence in sentences[:-1]:
                assert not _names_a_level(sentence), (question, sentence)
            assert {low, high} == _names_a_level(sentences[-1])


def test_stitch_hints_from_template_traces_never_hold_the_label() -> None:
    """What STITCH's hint would show of a template trace, at every success rate and in both hint modes."""
    settings = (StitchSettings(), StitchSettings(hint="fixed", fixed_hint_fraction=0.9))
    for low, high in [("sentence", "sentence"), ("paragraph", "document"), ("subsection", "section")]:
        sentences = trace_sentences(template_trace(low, high, "Who ruled the duchy of Normandy?"))
        for setting in settings:
            for rate in (0.0, 0.25, 0.5, 1.0):
                hint = " ".join(sentences[: hint_length(len(sentences), rate, setting)])
                assert hint and not _names_a_level(hint) and sentences[-1] not in hint
