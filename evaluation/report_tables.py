"""Markdown tables from the metrics files the jobs write, so the results page's figures can be regenerated.

docs/results.md marks each generated table with the file it comes from:

    <!-- table: planner runs/eval/planner/metrics.json -->
    ...the table...
    <!-- /table -->

``render_results_page`` replaces what lies between the markers with a fresh rendering of that file, and leaves a
table alone when its file does not exist here (a figure measured on another machine stays until rerun).
``python scripts/render_results.py`` applies it to docs/results.md; ``--check`` only reports stale tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from overstory.evaluation.compressor_paired import paired_methods_table
from overstory.evaluation.markdown import grid
from overstory.evaluation.paired import paired_table
from overstory.evaluation.pipeline_tables import harness_table, pipeline_qasper_table
from overstory.evaluation.planner_paired import paired_planners_table
from overstory.evaluation.repairs import repairs_cell

MARKER = re.compile(r"(<!-- table: (?P<kind>\w+) (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def planner_table(report: dict) -> str:
    """``eval planner`` metrics.json: one row per variant, then the majority-label reference. The repairs are the
    plans that could not be read, answered from the fallback range (``-`` in a report that predates the count).

    >>> print(planner_table({"variants": {"sft": {"accuracy": 0.5, "within_one_level": 0.75, "format_valid": 0.75,
    ...       "median_completion_tokens": 40.0, "p90_completion_tokens": 44.0, "seconds_per_plan": 1.234,
    ...       "repairs": {"plan_unparsed": 1}}}, "fallback_range": ["sentence", "paragraph"],
    ...       "majority_baseline": {"label": ["sentence", "section"], "accuracy": 0.25, "within_one_level": 0.5}}))
    | variant | accuracy vs label | within one level | format valid | strict format | median / p90 tokens | ...
    | --- | --- | --- | --- | --- | --- | --- | --- | --- |
    | sft | 0.500 | 0.750 | 0.75 | - | 40 / 44 | 1.23 | - | plan_unparsed 1 |
    | reference: always (sentence, section) | 0.250 | 0.500 | - | - | - | - | - | - |
    """
    rows = []
    for name, m in report["variants"].items():
        tokens = f"{_fmt(m.get('median_completion_tokens'), 0)} / {_fmt(m.get('p90_completion_tokens'), 0)}"
        rows.append([name, _fmt(m.get("accuracy")), _fmt(m.get("within_one_level")), _fmt(m.get("format_valid"), 2),
                     _fmt(m.get("format_valid_strict"), 2), tokens, _fmt(m.get("seconds_per_plan"), 2),
                     _fmt(m.get("qa_accuracy")), repairs_cell(m.get("repairs"))])
    majority = report["majority_baseline"]
    rows.append([f"reference: always ({', '.join(majority['label'])})", _fmt(majority["accuracy"]),
                 _fmt(majority["within_one_level"]), "-", "-", "-", "-", "-", "-"])
    return grid(["variant", "accuracy vs label", "within one level", "format valid", "strict format",
                  "median / p90 tokens", "s/plan", "QA accuracy", _fallback_header(report)], rows)


def _fallback_header(report: dict) -> str:
    """The repairs column's title, naming the range an unread plan was answered from where the report says."""
    fallback = report.get("fallback_range")
    return f"repairs (answered from {'..'.join(fallback)})" if fallback else "repairs"


def _with_ci(summary: dict, key: str, digits: int = 3) -> str:
    value, interval = summary.get(key), (summary.get("ci95") or {}).get(key)
    if value is None:
        return "-"
    return f"{value:.{digits}f} [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else _fmt(float(value), digits)


def planner_by_dataset_table(report: dict) -> str:
    """``eval planner`` metrics.json, per dataset: each variant, the dataset's own majority range and every fixed
    range, with 95% intervals (accuracy against gold levels and against the labels, QA score, the tokens the generator
    was given and the tokens of the chunks retrieved (``-`` in a report that predates the first), the mean size of the
    chunks retrieved: the SmartChunk paper's Figure 4b in numbers).

    >>> summary = {"n": 2, "accuracy": 0.5, "accuracy_gold": None, "qa_accuracy": 1.0, "tokens_read": 80.0,
    ...            "tokens_given": 72.0, "chunk_tokens": 16.0,
    ...            "ci95": {"accuracy": [0.0, 1.0], "qa_accuracy": [1.0, 1.0]}}
    >>> print(planner_by_dataset_table({"variants": {"sft": {"by_dataset": {"squad": {**summary, "repairs": {}}}}},
    ...       "majority_baseline": {"by_dataset": {"squad": {"dataset_label": {"label": ["sentence", "sentence"],
    ...       "n": 2, "accuracy": 0.0, "accuracy_gold": None}}}}}))
    | dataset | variant | n | accuracy vs gold | accuracy vs label | QA | tokens given | tokens retrieved | ...
    | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
    | squad | sft | 2 | - | 0.500 [0.00, 1.00] | 1.000 [1.00, 1.00] | 72 | 80 | 16 | 0 |
    | squad | reference: always sentence..sentence | 2 | - | 0.000 | - | - | - | - | - |
    """
    rows = []
    datasets = dict.fromkeys(d for m in report["variants"].values() for d in m.get("by_dataset", {}))
    fixed = report.get("fixed_ranges", {})
    for dataset in datasets:
        entries = [(name, m["by_dataset"][dataset]) for name, m in report["variants"].items()
                   if dataset in m.get("by_dataset", {})]
        planned = len(entries)  # the variants' rows; the references after them plan nothing
        own = report["majority_baseline"].get("by_dataset", {}).get(dataset, {}).get("dataset_label")
        if own:
            entries.append((f"reference: always {'..'.join(own['label'])}", own))
        for name, ranges in fixed.get("ranges", {}).items():
            if dataset in ranges.get("by_dataset", {}):
                best = " (best on training questions)" if fixed.get("best", {}).get("range") == name else ""
                entries.append((f"reference: fixed {name}{best}", ranges["by_dataset"][dataset]))
        for i, (name, summary) in enumerate(entries):
            rows.append([dataset, name, _fmt(summary.get("n")), _with_ci(summary, "accuracy_gold"),
                         _with_ci(summary, "accuracy"), _with_ci(summary, "qa_accuracy"),
                         _fmt(summary.get("tokens_given"), 0), _fmt(summary.get("tokens_read"), 0),
                         _with_ci(summary, "chunk_tokens", 0),
                         repairs_cell(summary.get("repairs")) if i < planned else "-"])
    return grid(["dataset", "variant", "n", "accuracy vs gold", "accuracy vs label", "QA", "tokens given",
                  "tokens retrieved", "chunk tokens", _fallback_header(report)], rows)


def _speedup(ratio: float | None) -> str:
    """A method's speed-up against summarize, ``-`` where the run had no summarize row (no summaries to redo)."""
    return "-" if ratio is None else f"{ratio}x"


def compressor_table(report: dict) -> str:
    """``eval compressor`` metrics.json: one row per way of embedding the upper levels, with its repairs (a failed
    summary replaced by the encoder on the chunk's text in the summarize row; ``-`` in an older report); a summarize
    row read back from its summaries job (``summarize: recorded``) says so."""
    k = report["config"]["k"]

    def recall(m: dict) -> str:  # with its 95% bootstrap interval where the report has one
        interval = m.get(f"recall@{k}_ci95")
        return _fmt(m.get(f"recall@{k}")) + (f" [{_fmt(interval[0])}, {_fmt(interval[1])}]" if interval else "")

    rows = [[name + (" (recorded by its job)" if m.get("source") else ""), _fmt(m["cosine_to_target"]), recall(m),
             _fmt(m["seconds"], 2),
             str(m["llm_completion_tokens"] + m["llm_prompt_tokens"]), _speedup(m["speedup_vs_summarize"]),
             repairs_cell(m.get("repairs"))]
            for name, m in report["methods"].items()]
    return grid(["method", "cosine to e_gt", f"recall@{k} [95% CI]", "seconds", "LLM tokens",
                  "speed-up vs summarize", "repairs"], rows)


def serve_bench_table(report: dict) -> str:
    """``bench serve`` bench.json: requests/s and latency per concurrency, each engine against the baseline."""
    engines = list(report["results"][0]["engines"])
    base = report["baseline"]
    header = ["concurrency", *[f"{e} req/s" for e in engines],
              *[f"{e} / {base}" for e in engines if e != base], *[f"{e} p50 / p95 s" for e in engines]]
    rows = [[str(r["concurrency"]), *[_fmt(r["engines"][e]["requests_per_s"], 2) for e in engines],
             *[_fmt(r["ratios"][e]["throughput"], 2) for e in engines if e != base],
             *[f"{_fmt(r['engines'][e]['p50_s'], 2)} / {_fmt(r['engines'][e]['p95_s'], 2)}" for e in engines]]
            for r in report["results"]]
    return grid(header, rows)


def teacher_engines_table(report: dict) -> str:
    """scripts/compare_teacher_engines.py's summary.json: per engine, the answers job (questions per minute, mean
    seconds and tokens per question, token F1) and the node-summaries job (calls, tokens, generation tokens/s), each
    throughput with its ratio to the baseline engine."""
    base = report["baseline"]
    rows = []
    for engine, row in report["engines"].items():
        a, s = row["answers"], row["summaries"]
        rows.append([engine, f"{a['questions']} in {_fmt(a['wall_s'], 0)} s", _fmt(a["questions_per_min"], 2),
                     _fmt(row["ratios"]["answers_questions_per_min"], 2), _fmt(a["mean_s_per_question"], 1),
                     f"{_fmt(a['tokens_in_per_question'], 0)} / {_fmt(a['tokens_out_per_question'], 1)}",
                     _fmt(a["token_f1"]), f"{s['llm_calls']} in {_fmt(s['wall_s'], 0)} s",
                     f"{s['tokens_in']} / {s['tokens_out']}", _fmt(s["teacher_tokens_per_s"], 2),
                     _fmt(row["ratios"]["summaries_tokens_per_s"], 2)])
    return grid(["engine", "answers: questions", "questions / min", f"vs {base}", "s / question (mean)",
                  "tokens in / out per question", "token F1", "summaries: calls", "tokens in / out",
                  "generation tokens/s", f"vs {base}"], rows)


def train_bench_table(report: dict) -> str:
    """``bench train`` bench.json: samples/s and peak memory per recipe and launcher, ratios to the first."""
    rows = [[recipe, launcher, _fmt(r["samples_per_s"], 2), _fmt(r["throughput_ratio"], 2),
             _fmt(r["peak_rss_mib"], 0), _fmt(r["memory_ratio"], 2)]
            for recipe, launchers in report["results"].items() for launcher, r in launchers.items()]
    return grid(["recipe", "launcher", "samples/s", "ratio", "peak RSS MiB (all processes)", "ratio"], rows)


def _quickstart_figures(name: str, stage: dict) -> str:
    """The headline figures of one quickstart stage, in words (empty for a stage this renderer does not know)."""
    if name == "hierarchy":
        return "; ".join(f"{corpus}: " + ", ".join(f"{row['count']} {level}" for level, row in levels.items())
                         for corpus, levels in stage.items() if isinstance(levels, dict))
    if name == "serving":
        return f"roles {', '.join(stage['roles'])} on a free port"
    if name == "retrieval":  # each corpus's scope: a SQuAD question within its own article, HotpotQA's everywhere
        scopes = {"document": ", each within its own document", "corpus": " over the whole corpus"}
        return "; ".join(f"{corpus}, {row['n_questions']} questions{scopes.get(row.get('scope'), '')}: " + ", ".join(
            f"{key.replace('_recall', ' recall')} {value:.3f}" for key, value in row.items() if "_recall@" in key)
            for corpus, row in stage.items() if isinstance(row, dict) and "n_questions" in row)
    if name == "rag_baseline":
        return (f"{stage['dataset']}, {stage['n_questions']} questions: exact match {stage['exact_match']:.3f}, "
                f"token F1 {stage['token_f1']:.3f}, answer contained {stage['contains_match']:.3f}"
                + _failed_and_repaired(stage))
    if name == "compressor":
        k = next((key for key in next(iter(stage["methods"].values())) if key.startswith("recall@")), "recall@5")
        return f"{stage['n_questions']} questions, {k}: " + ", ".join(
            f"{method} {row[k]:.3f}" for method, row in stage["methods"].items())
    if name == "planner":
        if "variants" not in stage:
            return stage.get("skipped", "")
        planned = stage["n_questions"] + stage.get("n_unlabelled", 0)
        return (f"{stage['pseudo_labels']['correct']} correct pseudo-labels of "
                f"{stage['pseudo_labels']['correct'] + stage['pseudo_labels']['unsolved']}; format valid (strict) on "
                f"{planned} held-out questions: " + ", ".join(
                    f"{variant} {row['format_valid']:.2f} ({_fmt(row.get('format_valid_strict'), 2)})"
                    for variant, row in stage["variants"].items()))
    if name == "lattice":
        tree = stage["tree"]
        return (f"tree of {tree['stats']['leaves']} {stage['dataset']} paragraphs, depth {tree['stats']['depth']} "
                f"({tree['summaries']['llm_calls']} LLM calls); {stage['traces']['questions']} traced questions; "
                f"nDCG@10 on {stage['n_questions']} held-out: " + ", ".join(
                    f"{system} {_fmt(row['ndcg@10'])}" for system, row in stage["systems"].items()))
    if name == "strategies":
        return "contains-match / generator tokens per question: " + "; ".join(
            f"{corpus} ({row['n_questions']} questions) " + ", ".join(
                f"{strategy} {_fmt(figures['contains_match'], 2)} / {_fmt(figures['generator_tokens'], 0)}"
                + _failed_and_repaired({"n_questions": row["n_questions"], **figures})
                for strategy, figures in row["strategies"].items())
            for corpus, row in stage["corpora"].items())
    return ""


def _failed_and_repaired(row: dict) -> str:
    """`` (failed k, repairs: ...)`` after an evaluation row's figures when any question failed or was repaired
    (nothing for a clean row or a report that predates the counts).

    >>> _failed_and_repaired({"n_questions": 2, "answered": 1, "repairs": {"plan_unparsed": 1}})
    ' (failed 1, repairs: plan_unparsed 1)'
    >>> _failed_and_repaired({"n_questions": 2, "answered": 2, "repairs": {}})
    ''
    """
    notes = []
    if "answered" in row and row["answered"] < row["n_questions"]:
        notes.append(f"failed {row['n_questions'] - row['answered']}")
    if row.get("repairs"):
        notes.append(f"repairs: {repairs_cell(row['repairs'])}")
    return f" ({', '.join(notes)})" if notes else ""


def quickstart_table(report: dict) -> str:
    """The quickstart's report.json: seconds and headline figures per stage, then the total.

    >>> print(quickstart_table({"stages": {"serving": {"roles": ["generator"], "seconds": 20.4},
    ...                                    "later": {"x": 1}}, "total_seconds": 31.0}))
    | stage | seconds | figures |
    | --- | --- | --- |
    | serving | 20 | roles generator on a free port |
    | later | - |  |
    | total | 31 |  |
    """
    rows = [[name, _fmt(stage.get("seconds"), 0), _quickstart_figures(name, stage)]
            for name, stage in report["stages"].items() if isinstance(stage, dict)]
    rows.append(["total", _fmt(report.get("total_seconds"), 0), ""])
    return grid(["stage", "seconds", "figures"], rows)


def _rate(figure: dict | None) -> str:
    """A rate with its 95% interval from ``{"value": v, "ci95": [lo, hi]}`` (``-`` where there is none)."""
    if not figure or figure.get("value") is None:
        return "-"
    low, high = figure["ci95"]
    return f"{figure['value']:.3f} [{low:.2f}, {high:.2f}]"


def pseudo_labels_table(summary: dict) -> str:
    """``data pseudo-labels``' summary.json: per labelling rule, how many questions it gives a range, its most common
    ranges and, where the dataset has gold levels, its agreement with them (95% intervals).

    >>> print(pseudo_labels_table({"labels": 4, "labelled": 3, "labelled_at_attempt": {"1": 2, "3": 1},
    ...     "grounding": {"grounded": 2, "ungrounded": 1, "unlabelled": 1},
    ...     "ranges": {"method": {"sentence..section": 2, "paragraph..section": 1},
    ...                "grounded": {"sentence..sentence": 2}},
    ...     "agreement": {"method": {"exact_range": {"value": 0.0, "ci95": [0.0, 0.0]}},
    ...                   "grounded": {"exact_range": {"value": 0.5, "ci95": [0.0, 1.0]}}}}))
    | labelling rule | questions with a range | most common ranges | exact range vs gold | level_min | level_max | ...
    | --- | --- | --- | --- | --- | --- | --- |
    | method: the levels read when the answer was right | 3 of 4 (at attempt 1: 2, 3: 1) | sentence..section 2, ...
    | answer-grounded: where the reply lies | 2 of 4 (1 correct but not grounded) | sentence..sentence 2 | 0.500 ...
    """
    rows = []
    attempts = ", ".join(f"{attempt}: {n}" for attempt, n in summary["labelled_at_attempt"].items())
    for rule, name, ranged, note in (
            ("method", "method: the levels read when the answer was right", summary["labelled"],
             f"at attempt {attempts}"),
            ("grounded", "answer-grounded: where the reply lies", summary["grounding"]["grounded"],
             f"{summary['grounding']['ungrounded']} correct but not grounded")):
        common = ", ".join(f"{span} {n}" for span, n in list(summary["ranges"][rule].items())[:3]) or "-"
        agreement = summary.get("agreement", {}).get(rule, {})
        rows.append([name, f"{ranged} of {summary['labels']} ({note})", common,
                     *(_rate(agreement.get(k)) for k in ("exact_range", "level_min", "level_max", "within_one"))])
    return grid(["labelling rule", "questions with a range", "most common ranges", "exact range vs gold",
                  "level_min", "level_max", "within one level"], rows)


def lattice_table(report: dict) -> str:
    """``eval lattice``'s own table (imported here, not at the top: that module loads the retrieval stack)."""
    from overstory.evaluation.lattice import markdown_table

    return markdown_table(report)


RENDERERS: dict[str, Callable[[dict], str]] = {
    "planner": planner_table, "planner_by_dataset": planner_by_dataset_table, "compressor": compressor_table,
    "serve_bench": serve_bench_table, "train_bench": train_bench_table, "quickstart": quickstart_table,
    "lattice": lattice_table, "pipeline": harness_table, "pipeline_qasper": pipeline_qasper_table,
    "teacher_engines": teacher_engines_table, "pseudo_labels": pseudo_labels_table, "answers_paired": paired_table,
    "planner_paired": paired_planners_table, "compressor_paired": paired_methods_table,
}


def render_results_page(text: str, root: str | Path = ".") -> tuple[str, list[str]]:
    """(the README with every table whose file exists re-rendered, a line per table saying what happened)."""
    notes = []

    def replace(match: re.Match) -> str:
        path = Path(root) / match["path"]
        if match["kind"] not in RENDERERS:
            raise ValueError(f"unknown table kind {match['kind']!r}; known: {', '.join(RENDERERS)}")
        if not path.exists():
            notes.append(f"kept {match['kind']}: {match['path']} not found")
            return match.group(0)
        body = RENDERERS[match["kind"]](json.loads(path.read_text()))
        notes.append(f"{'unchanged' if body == match['body'] else 'rendered'} {match['kind']} from {match['path']}")
        return f"{match.group(1)}{body}{match.group(5)}"

    return MARKER.sub(replace, text), notes
