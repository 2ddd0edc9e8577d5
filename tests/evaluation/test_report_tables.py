"""README tables rendered from metrics files: only the marked block changes, missing files keep their table."""

from __future__ import annotations

import json
from pathlib import Path

from overstory.evaluation.report_tables import (
    compressor_table,
    planner_by_dataset_table,
    planner_table,
    quickstart_table,
    render_results_page,
)


def test_render_replaces_only_marked_tables_whose_file_exists(tmp_path: Path) -> None:
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "report.json").write_text(json.dumps({"stages": {
        "retrieval": {"squad": {"n_questions": 9, "levels": ["paragraph"], "bm25_recall@5": 0.5},
                      "seconds": 12.4},
        "planner": {"skipped": "no correct answer", "seconds": 301.0}}, "total_seconds": 320.0}))
    readme = ("intro\n<!-- table: quickstart q/report.json -->\nold table\n<!-- /table -->\nmiddle\n"
              "<!-- table: planner missing/metrics.json -->\nkept table\n<!-- /table -->\nend\n")
    rendered, notes = render_results_page(readme, tmp_path)
    assert ("| retrieval | 12 | squad, 9 questions: bm25 recall@5 0.500 |\n| planner | 301 | no correct answer |\n"
            "| total | 320 |  |\n<!-- /table -->") in rendered
    assert "old table" not in rendered and "kept table" in rendered
    assert rendered.startswith("intro\n") and "\nmiddle\n" in rendered and rendered.endswith("end\n")
    assert notes == ["rendered quickstart from q/report.json", "kept planner: missing/metrics.json not found"]
    again, notes = render_results_page(rendered, tmp_path)
    assert again == rendered and notes[0].startswith("unchanged")


def test_compressor_table_shows_recall_with_its_interval_and_the_repairs_where_the_report_has_them() -> None:
    row = {"cosine_to_target": 0.9, "seconds": 0.5, "llm_completion_tokens": 0, "llm_prompt_tokens": 0,
           "speedup_vs_summarize": 10.0}
    table = compressor_table({"config": {"k": 5}, "methods": {
        "mean_pool": {**row, "recall@5": 0.5, "recall@5_ci95": [0.25, 0.75], "repairs": {}},
        "summarize": {**row, "recall@5": 0.5, "repairs": {"summary_failed_direct_encode": 2}},
        "older_report": {**row, "recall@5": 0.4}}})
    assert "| recall@5 [95% CI] |" in table and table.splitlines()[0].endswith("| repairs |")
    assert "| mean_pool | 0.900 | 0.500 [0.250, 0.750] |" in table and "| older_report | 0.900 | 0.400 |" in table
    assert table.splitlines()[3].endswith("| 10.0x | summary_failed_direct_encode 2 |")
    assert table.splitlines()[2].endswith("| 0 |") and table.splitlines()[4].endswith("| - |")
    # a run without summaries (groups): no cosine to e_gt and no summarize row to compare speed with
    no_summaries = {**row, "cosine_to_target": None, "speedup_vs_summarize": None, "recall@5": 0.6, "repairs": {}}
    assert compressor_table({"config": {"k": 5}, "methods": {"mean_pool": no_summaries}}).splitlines()[2] == (
        "| mean_pool | - | 0.600 | 0.50 | 0 | - | 0 |")


def test_planner_tables_show_the_plans_answered_from_the_fallback_range() -> None:
    variant = {"accuracy": 0.5, "format_valid": 0.5, "repairs": {"plan_unparsed": 3},
               "by_dataset": {"squad": {"n": 6, "repairs": {"plan_unparsed": 3}}}}
    report = {"variants": {"base": variant}, "fallback_range": ["sentence", "paragraph"],
              "majority_baseline": {"label": ["sentence", "section"], "accuracy": 0.25, "within_one_level": 0.5}}
    for table in (planner_table(report), planner_by_dataset_table(report)):
        assert table.splitlines()[0].endswith("| repairs (answered from sentence..paragraph) |")
        assert table.splitlines()[2].endswith("| plan_unparsed 3 |")


def test_the_quickstart_table_names_each_strategys_quality_and_cost() -> None:
    stage = {"seconds": 300.2, "strategies": ["naive", "arag"], "corpora": {
        "squad": {"n_questions": 2, "strategies": {
            "naive": {"contains_match": 0.5, "generator_tokens": 610.4, "answered": 2, "repairs": {}},
            "arag": {"contains_match": 0.0, "generator_tokens": 2210.0, "answered": 1,
                     "repairs": {"tool_failures.truncated_call": 1}}}}}}
    table = quickstart_table({"stages": {"strategies": stage}, "total_seconds": 301})
    assert ("| strategies | 300 | contains-match / generator tokens per question: squad (2 questions) naive 0.50 / "
            "610, arag 0.00 / 2210 (failed 1, repairs: tool_failures.truncated_call 1) |") in table
