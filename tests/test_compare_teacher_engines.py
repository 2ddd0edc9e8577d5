"""scripts/compare_teacher_engines.py on outputs shaped as its two jobs write them (eval pipeline's metrics.json and
the wall time beside it; teacher_runs.sh's finished-job record), per engine: the throughputs and their ratios against
the first engine, by hand, and the results page's table rendered from the summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from overstory.evaluation.report_tables import RENDERERS

ROOT = Path(__file__).resolve().parents[1]


def write_engine(root: Path, engine: str, wall: float, tokens_out: int, summaries_wall: float) -> None:
    answers = root / engine / "eval-naive"
    answers.mkdir(parents=True)
    naive = {"n_questions": 8, "answered": 8, "seconds": 30.0, "llm_input_tokens": 600.0, "llm_output_tokens": 7.5,
             "token_f1": 0.2}
    (answers / "metrics.json").write_text(json.dumps({"strategies": {"naive": naive}}))
    (answers / "wall_s").write_text(f"{wall}\n")
    jobs = root / engine / "jobs"
    jobs.mkdir()
    (jobs / "tree-qasper_dev.json").write_text(json.dumps({
        "job": "tree-qasper_dev", "wall_s": summaries_wall, "llm_calls": 20, "failed_llm_calls": 0,
        "tokens_in": 15000, "tokens_out": tokens_out, "teacher_tokens_per_s": round(tokens_out / summaries_wall, 2)}))


def test_the_summary_gives_each_engines_throughput_against_the_first(tmp_path: Path) -> None:
    write_engine(tmp_path, "embedded", wall=240.0, tokens_out=2000, summaries_wall=400.0)
    write_engine(tmp_path, "vllm", wall=120.0, tokens_out=2000, summaries_wall=200.0)
    done = subprocess.run([sys.executable, "scripts/compare_teacher_engines.py", str(tmp_path), "embedded", "vllm"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    embedded, vllm = summary["engines"]["embedded"], summary["engines"]["vllm"]
    assert embedded["answers"]["questions_per_min"] == 2.0 and vllm["answers"]["questions_per_min"] == 4.0
    assert embedded["summaries"]["calls_per_min"] == 3.0 and vllm["summaries"]["teacher_tokens_per_s"] == 10.0
    assert vllm["ratios"] == {"answers_questions_per_min": 2.0, "summaries_tokens_per_s": 2.0}
    assert embedded["ratios"] == {"answers_questions_per_min": 1.0, "summaries_tokens_per_s": 1.0}
    table = RENDERERS["teacher_engines"](summary)
    assert table in done.stdout
    row = "| vllm | 8 in 120 s | 4.00 | 2.00 | 30.0 | 600 / 7.5 | 0.200 | 20 in 200 s | 15000 / 2000 | 10.00 | 2.00 |"
    assert row in table
