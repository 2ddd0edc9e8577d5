"""`overstory eval lattice`'s recorded system: a traces job's search read instead of run again. The session's oracle
traces (tests/conftest.py: a real ``data lattice-traces`` run with the gold-label scorer, deterministic and model-free)
are the record; the live oracle search under the same settings is what it must equal. Refusals: other ranking
settings (naming the key), a question without a record, other gold leaves, no settings record. The students'
agreement reads the held-out slates of several traces files as of one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.evaluation.lattice import LatticeEvalConfig
from overstory.evaluation.lattice_agreement import heldout_slates
from overstory.models.scorer import SLATE_SCHEMA
from tests.conftest import HOTPOTQA_150, ROOT

ITERATIONS = "search.iterations=4"  # as the session's oracle traces were searched


def _args(out: Path, tree: Path, traces: Path, *extra: str) -> list[str]:
    """eval lattice over the session's tree, with ``teacher`` read from ``traces``."""
    return ["eval", "lattice", "--config", str(ROOT / "configs/eval/lattice.yaml"), *HOTPOTQA_150, f"out={out}",
            "tracking.backend=none", f"tree={tree}", "heldout_from=", "agreement_traces=", ITERATIONS,
            "systems.teacher.kind=recorded", f"systems.teacher.traces={traces}", *extra]


def _rankings(out: Path, name: str) -> dict[str, list]:
    lines = (out / "rankings" / f"{name}.jsonl").read_text().splitlines()
    return {(r := json.loads(line))["id"]: r["ranking"] for line in lines}


def test_the_recorded_row_is_the_live_search(lattice_tree: Path, lattice_oracle_traces: Path, tmp_path: Path) -> None:
    """The oracle searched live (calibration on, as the traces job searched) and read from its traces give the same
    rankings, metrics, slates and repairs; a fusion of the recorded row is the fusion of the live one; the table's
    ratio columns read the recorded teacher; with the job's wall time (job_record), seconds are it per question."""
    out = tmp_path / "eval"
    job = tmp_path / "traces-job.json"
    job.write_text(json.dumps({"job": "traces", "finished": True, "wall_s": 22.0}))
    assert main([*_args(out, lattice_tree, lattice_oracle_traces), "systems.oracle.calibration=true",
                 "systems.live++.kind=fusion", "systems.live++.of=oracle", "systems.timed.kind=recorded",
                 f"systems.timed.traces={lattice_oracle_traces}", f"systems.timed.job_record={job}",
                 "--compare", "oracle,teacher,timed,bm25,lattice++,live++"]) == 0
    report = json.loads((out / "metrics.json").read_text())
    live, recorded = report["systems"]["oracle"], report["systems"]["teacher"]
    assert report["n_questions"] == 11
    assert _rankings(out, "teacher") == _rankings(out, "oracle")
    for key in ("ndcg@10", "ndcg@10_ci95", "recall@10", "recall@100", "llm_calls", "slates", "slates_total",
                "failed_slates", "problems", "repairs", "routing"):
        assert recorded[key] == live[key], key
    assert recorded["kind"] == "recorded" and recorded["served_by"] == "oracle" and recorded["seconds"] >= 0
    assert "not re-run" in recorded["note"] and recorded["slates_total"] > 0
    timed = report["systems"]["timed"]
    assert timed["seconds"] == 2.0 and timed["latency_seconds"] == recorded["seconds"] == recorded["latency_seconds"]
    assert "the job's wall time over its 11 questions" in timed["note"]
    assert _rankings(out, "lattice++") == _rankings(out, "live++")
    assert report["systems"]["lattice++"]["slates_total"] == recorded["slates_total"]  # the fusion costs its search
    table = (out / "table.md").read_text()
    assert "nDCG@10 / teacher's" in table
    teacher_line = next(line for line in table.splitlines() if line.startswith("| teacher |"))
    speed = "1x" if recorded["seconds"] > 0 else "-"  # an oracle search may round to 0 s a question
    assert f"| 1.00 | {speed} |" in teacher_line and "served by oracle" in teacher_line
    assert live["ndcg@10"] > 0  # the ratio column compares a real figure


def test_a_record_made_under_other_settings_is_refused_naming_the_key(lattice_tree: Path, lattice_oracle_traces: Path,
                                                                      tmp_path: Path, capsys) -> None:
    """Before anything runs: another search setting, slate size or tree (path) than the traces job's."""
    args = [*_args(tmp_path / "eval", lattice_tree, lattice_oracle_traces), "--compare", "teacher"]
    assert main([*args, "search.iterations=5", "max_candidate_chars=300"]) == 2
    err = capsys.readouterr().err
    assert "systems.teacher.traces: the recorded search ran under other settings" in err
    assert "max_candidate_chars (recorded 600, this eval 300)" in err
    assert "search.iterations (recorded 4, this eval 5)" in err
    assert main([*args, "systems.teacher.calibration=false"]) == 2
    assert "search.calibration (recorded True, this eval False)" in capsys.readouterr().err
    moved = tmp_path / "tree.json"
    shutil.copy(lattice_tree, moved)
    assert main([*args, f"tree={moved}"]) == 2
    assert "other settings than this eval's: tree (recorded" in capsys.readouterr().err
    assert not (tmp_path / "eval" / "metrics.json").exists()


def test_a_record_made_under_the_older_slate_schema_is_refused(lattice_tree: Path, lattice_oracle_traces: Path,
                                                               tmp_path: Path, capsys) -> None:
    """Traces whose settings lack the reply schema's version were scored under the schema that let the teacher stop
    after one candidate: another teacher's search, refused by name."""
    traces = _copied_traces(lattice_oracle_traces, tmp_path / "old")
    settings = json.loads(traces.with_name(traces.stem + ".settings.json").read_text())
    assert settings.pop("slate_schema") == SLATE_SCHEMA
    traces.with_name(traces.stem + ".settings.json").write_text(json.dumps(settings))
    assert main([*_args(tmp_path / "eval", lattice_tree, traces), "--compare", "teacher"]) == 2
    assert f"slate_schema (recorded None, this eval {SLATE_SCHEMA!r})" in capsys.readouterr().err


def _copied_traces(traces: Path, folder: Path) -> Path:
    folder.mkdir()
    for suffix in (".jsonl", ".queries.jsonl", ".settings.json"):
        shutil.copy(traces.with_name(traces.stem + suffix), folder / (traces.stem + suffix))
    return folder / traces.name


def test_missing_questions_other_gold_and_no_settings_are_refused(lattice_tree: Path, lattice_oracle_traces: Path,
                                                                 tmp_path: Path, capsys) -> None:
    copy = _copied_traces(lattice_oracle_traces, tmp_path / "traces")
    queries = copy.with_name("traces.queries.jsonl")
    records = [json.loads(line) for line in queries.read_text().splitlines()]
    args = [*_args(tmp_path / "eval", lattice_tree, copy), "--compare", "teacher"]
    queries.write_text("".join(json.dumps(r) + "\n" for r in records[1:]))
    assert main(args) == 2
    assert (f"systems.teacher.traces: 1 of the 11 questions searched have no record in {queries} "
            f"(e.g. {records[0]['id']})") in capsys.readouterr().err
    other_gold = {**records[0], "gold": records[0]["gold"][:-1]}
    queries.write_text("".join(json.dumps(r) + "\n" for r in [other_gold, *records[1:]]))
    assert main(args) == 2
    assert f"question {records[0]['id']}'s recorded gold leaves" in capsys.readouterr().err
    queries.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([*args, f"systems.teacher.job_record={tmp_path / 'no-such-job.json'}"]) == 2
    err = capsys.readouterr().err
    assert "systems.teacher.job_record: " in err and "holds no finished job's wall_s" in err
    copy.with_name("traces.settings.json").unlink()
    assert main(args) == 2
    assert "traces.settings.json not found: a recorded system reads the settings" in capsys.readouterr().err


def test_a_recorded_system_needs_its_traces_and_fusion_accepts_it(tmp_path: Path) -> None:
    base = ["tracking.backend=none", f"out={tmp_path}", "systems.teacher.kind=recorded"]
    with pytest.raises(ConfigError, match="systems.teacher.traces: a recorded system needs the traces file"):
        load_config(LatticeEvalConfig, ROOT / "configs/eval/lattice.yaml", base)
    config = load_config(LatticeEvalConfig, ROOT / "configs/eval/lattice.yaml",
                         [*base, "systems.teacher.traces=t.jsonl", "compare=teacher,lattice++"])
    assert config.systems["lattice++"].of == "teacher" and config.names == ["teacher", "lattice++"]


def test_agreement_reads_the_held_out_slates_of_every_file(lattice_oracle_traces: Path, tmp_path: Path) -> None:
    """The slates of two files (the session's traces cut in two by query) are those of the one file, in order; a
    comma-separated override and a YAML list name the same files."""
    slates = [json.loads(line) for line in lattice_oracle_traces.read_text().splitlines()]
    ids = sorted({s["query_id"] for s in slates})
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(s) + "\n" for s in slates if s["query_id"] in ids[:5]))
    second.write_text("".join(json.dumps(s) + "\n" for s in slates if s["query_id"] not in ids[:5]))
    (tmp_path / "student").mkdir()
    (tmp_path / "student" / "heldout_queries.json").write_text(json.dumps([ids[0], ids[-1]]))
    model = str(tmp_path / "student" / "final")
    both = heldout_slates([str(first), str(second)], model)
    assert {s["query_id"] for s in both} == {ids[0], ids[-1]}
    assert sorted(s["id"] for s in both) == sorted(s["id"] for s in heldout_slates([str(lattice_oracle_traces)], model))
    for value in (f"{first},{second}", f"[{first}, {second}]"):
        config = load_config(LatticeEvalConfig, ROOT / "configs/eval/lattice.yaml",
                             ["tracking.backend=none", f"agreement_traces={value}"])
        assert config.agreement_files == [str(first), str(second)]
