"""Collect scripts/compare_teacher_engines.sh's runs into one summary: per engine, the answers job (eval pipeline's
naive strategy: questions per minute over the run's wall time, mean seconds per question, tokens per question, token
F1 as a check that both engines answered alike) and the node-summaries job (teacher_runs.sh's record: wall time,
calls, tokens, generation tokens/s), each with its ratio against the first engine named (the baseline).

    python scripts/compare_teacher_engines.py runs/teacher-engines embedded vllm

Writes <folder>/summary.json (rendered on docs/results.md by the `teacher_engines` table kind) and prints the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from overstory.evaluation.report_tables import teacher_engines_table


def answers(folder: Path) -> dict:
    """The answers job of one engine: eval pipeline's metrics.json (naive) and the run's wall time."""
    naive = json.loads((folder / "metrics.json").read_text())["strategies"]["naive"]
    wall = float((folder / "wall_s").read_text())
    return {"questions": naive["n_questions"], "answered": naive["answered"], "wall_s": round(wall, 1),
            "questions_per_min": round(60 * naive["n_questions"] / wall, 2), "mean_s_per_question": naive["seconds"],
            "tokens_in_per_question": naive["llm_input_tokens"], "tokens_out_per_question": naive["llm_output_tokens"],
            "token_f1": naive["token_f1"]}


def summaries(record: Path) -> dict:
    """The node-summaries job of one engine: teacher_runs.sh's finished-job record."""
    job = json.loads(record.read_text())
    return {key: job[key] for key in ("wall_s", "llm_calls", "failed_llm_calls", "tokens_in", "tokens_out",
                                      "teacher_tokens_per_s")} | {
        "calls_per_min": round(60 * job["llm_calls"] / job["wall_s"], 2) if job["wall_s"] else 0.0}


def main(argv: list[str]) -> int:
    root, engines = Path(argv[0]), argv[1:]
    result = {"baseline": engines[0], "engines": {
        engine: {"answers": answers(root / engine / "eval-naive"),
                 "summaries": summaries(root / engine / "jobs" / "tree-qasper_dev.json")} for engine in engines}}
    base = result["engines"][engines[0]]
    for row in result["engines"].values():
        row["ratios"] = {"answers_questions_per_min": round(row["answers"]["questions_per_min"]
                                                            / base["answers"]["questions_per_min"], 2),
                         "summaries_tokens_per_s": round(row["summaries"]["teacher_tokens_per_s"]
                                                         / base["summaries"]["teacher_tokens_per_s"], 2)}
    (root / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(teacher_engines_table(result))
    print(f"-> {root / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
