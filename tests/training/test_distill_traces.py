"""`overstory train distill-scorer` on several traces files: the session's oracle traces (tests/conftest.py) cut in two
by query stand for two datasets' traces. The split by query is over their union, the manifest lists each file, the
resume check covers all files in order, a question traced in both files is refused by name, and the command line
names several files as a YAML list or comma-separated."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import load_config
from overstory.training.distill_data import heldout_queries, read_trace_files
from overstory.training.distill_scorer import DistillScorerConfig, traces_digest
from tests.conftest import ROOT

VAL_FRACTION = 0.4  # about 4 of the 11 questions held out, so each file holds some


def _split(traces: Path, folder: Path, shared: int = 0) -> tuple[Path, Path, set[str]]:
    """Two files cut from ``traces`` by query, each holding some held-out queries (and ``shared`` of the first
    file's queries in the second too); returns them with the held-out ids over the union."""
    slates = [json.loads(line) for line in traces.read_text().splitlines()]
    ids = sorted({s["query_id"] for s in slates})
    held = heldout_queries(set(ids), VAL_FRACTION)
    order = sorted(held) + sorted(set(ids) - held)
    first_ids = set(order[::2])  # alternate: held-out queries fall in both files
    second_ids = set(order) - first_ids | set(sorted(first_ids)[:shared])
    first, second = folder / "hotpotqa.jsonl", folder / "qasper.jsonl"
    first.write_text("".join(json.dumps(s) + "\n" for s in slates if s["query_id"] in first_ids))
    second.write_text("".join(json.dumps(s) + "\n" for s in slates if s["query_id"] in second_ids))
    return first, second, held


def _distill(traces: str, out: Path, *overrides: str) -> int:
    return main(["train", "distill-scorer", "--config", str(ROOT / "configs/train/distill_scorer_cross_encoder.yaml"),
                 f"traces={traces}", f"out={out}", f"train.val_fraction={VAL_FRACTION}", "tracking.backend=none",
                 "train.batch_size=4", "train.max_length=64", "max_candidate_chars=100", "train.save_steps=1",
                 *overrides])


def test_two_trace_files_are_split_by_query_over_their_union(lattice_oracle_traces: Path, tmp_path: Path,
                                                             capsys) -> None:
    first, second, held = _split(lattice_oracle_traces, tmp_path)
    by_file = [{s.query_id for s in read_trace_files([str(path)])} for path in (first, second)]
    assert held & by_file[0] and held & by_file[1]  # the split's held-out queries come from both files
    out = tmp_path / "ce"
    assert _distill(f"[{first}, {second}]", out, "train.max_steps=1") == 0
    assert set(json.loads((out / "heldout_queries.json").read_text())) == held
    manifest = json.loads((out / "final" / "overstory.json").read_text())
    assert manifest["traces"] == [str(first), str(second)] and manifest["teachers"] == ["oracle"]
    assert [f["path"] for f in manifest["trace_files"]] == [str(first), str(second)]
    assert [f["sha256"] for f in manifest["trace_files"]] == [traces_digest([str(first)]), traces_digest([str(second)])]
    digest = json.loads((out / "resume_settings.json").read_text())["settings"]["traces_sha256"]
    assert digest == traces_digest([str(first), str(second)]) != traces_digest([str(second), str(first)])
    capsys.readouterr()
    # the same files in the other order are other settings for the checkpoints: refused before out changes
    assert _distill(f"{second},{first}", out, "train.max_steps=2") == 2
    assert "was trained with other settings (traces_sha256 differ)" in capsys.readouterr().err
    assert set(json.loads((out / "heldout_queries.json").read_text())) == held


def test_a_question_traced_in_two_files_is_refused_by_name(lattice_oracle_traces: Path, tmp_path: Path) -> None:
    first, second, _ = _split(lattice_oracle_traces, tmp_path, shared=1)
    shared = sorted({s.query_id for s in read_trace_files([str(first)])})[0]
    with pytest.raises(ValueError, match=re.escape(f"question {shared} is traced in both {first} and {second}")):
        _distill(f"{first},{second}", tmp_path / "ce", "train.max_steps=1")
    assert not (tmp_path / "ce").exists()


def test_traces_name_one_file_or_several(tmp_path: Path) -> None:
    def files(*overrides: str) -> list[str]:
        config = load_config(DistillScorerConfig, ROOT / "configs/train/distill_scorer_cross_encoder-teacher.yaml",
                             ["tracking.backend=none", *overrides])
        return config.trace_files

    assert files() == ["runs/teacher/lattice/hotpotqa/traces.jsonl", "runs/teacher/lattice/qasper_train/traces.jsonl"]
    assert files("traces=a.jsonl") == ["a.jsonl"]
    assert files("traces=a.jsonl,b.jsonl") == files("traces=[a.jsonl, b.jsonl]") == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ValueError, match="traces: name at least one traces file"):
        files("traces=[]")


def _students_script_configs(monkeypatch: pytest.MonkeyPatch, **env: str) -> tuple[list, list]:
    """The configs of every command scripts/lattice_students.sh --dry-run prints (under ``env``), each loaded through
    the CLI as the script would run it (nothing runs): the students' and the two evals'."""
    from overstory import cli
    from overstory.cli import job_config_class

    done = subprocess.run(["bash", str(ROOT / "scripts/lattice_students.sh"), "--dry-run"], cwd=ROOT, text=True,
                          capture_output=True, env={**os.environ, "OVERSTORY": "false", **env})
    assert done.returncode == 0, done.stderr
    loaded = []
    monkeypatch.setattr(cli, "run_job", lambda g, n, config_path, overrides: loaded.append(
        load_config(job_config_class(g, n), ROOT / config_path, overrides)))
    monkeypatch.chdir(ROOT)
    for line in done.stdout.splitlines():
        assert cli.main(shlex.split(line)[1:]) == 0, line
    return loaded[:-2], loaded[-2:]


def test_the_students_script_trains_what_the_evals_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/lattice_students.sh --dry-run: every command it would run loads its config through the CLI, each
    student gets a folder of its own on both teacher trace files, and every student row of both evals reads one of
    those folders (nothing runs)."""
    students, evals = _students_script_configs(monkeypatch)
    assert len(students) == 7 and len({s.out for s in students}) == 7
    assert all(len(s.trace_files) == 2 and s.train.val_fraction == students[0].train.val_fraction for s in students)
    finals = {f"{s.out}/final" for s in students}
    for config in evals:
        rows = {system.model for system in config.systems.values() if system.model}
        assert rows == finals and config.systems["teacher"].kind == "recorded"
        assert config.heldout_from in {s.out for s in students}

    # some students only: those trained, and the evals compare exactly them beside the teacher and the baselines
    students, evals = _students_script_configs(monkeypatch, LATTICE_STUDENTS="llm ce_gold")
    assert [Path(s.out).name for s in students] == ["llm", "ce_gold"]
    for config in evals:
        compared = config.compare.split(",")
        assert set(compared) <= set(config.systems)
        assert {config.systems[name].model for name in compared if config.systems[name].model} == {
            f"{s.out}/final" for s in students}
        assert config.heldout_from == students[0].out  # ce_pointwise, the configs' own, is not trained here
