"""The tables of ``eval pipeline``'s metrics.json: the harness's own (quality with intervals, cost, failures and
repairs per strategy) and, for a QASPER run, QASPER's official metrics per strategy. ``eval pipeline`` prints and
saves both (table.md); docs/results.md renders each from a run's file (report_tables' ``pipeline`` and
``pipeline_qasper`` kinds)."""

from __future__ import annotations

from overstory.evaluation.markdown import grid
from overstory.evaluation.repairs import repairs_cell
from overstory.evaluation.scope import scope_title

QUALITY = ("exact_match", "token_f1", "contains_match", "rouge_l")  # the answer scores of every strategy's row


def pipeline_table(report: dict) -> str:
    """What ``eval pipeline`` prints and saves as table.md: the harness's table, then QASPER's for a QASPER run."""
    qasper = pipeline_qasper_table(report)
    return harness_table(report) + (f"\n{qasper}" if qasper else "")


def harness_table(report: dict) -> str:
    """One row per strategy: quality with intervals, cost per question, failed questions by kind, the repairs
    inside answered questions by kind, a tree search's failed slates and whether the costs added up; then how
    often the judge agreed with contain-match, and a warning when the judge refused reference answers."""
    k = report["recall_k"]
    header = ["strategy", "EM", "F1", "contains", "ROUGE-L", f"recall@{k}", "judge", "LLM calls / q",
              "tokens in / out per q", "generator tokens / q", "s / q", "failed", "repairs", "failed slates",
              "costs add up"]

    def cell(row: dict, key: str) -> str:
        value, interval = row.get(key), row.get(f"{key}_ci95")
        if value is None:
            return "-"
        return f"{value:.3f} [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else f"{value:.3f}"

    rows = [[name, *(cell(row, key) for key in (*QUALITY, f"recall@{k}", "judge")), f"{row['llm_calls']:g}",
             f"{row['llm_input_tokens']:g} / {row['llm_output_tokens']:g}", f"{row['generator_tokens']:g}",
             f"{row['seconds']:.2f}", _failed_cell(row), repairs_cell(row.get("repairs")),
             _slates_cell(row.get("slates")), _cost_cell(row.get("costs_add_up"))]
            for name, row in report["strategies"].items()]
    lines = [f"{scope_title(report)}\n"] if "scope" in report else []
    lines.append(grid(header, rows).rstrip("\n"))
    agreements = [f"{name} {a['both'] + a['neither']}/{a['n']} (judge only {a['judge_only']}, contains only "
                  f"{a['contains_only']})" for name, row in report["strategies"].items()
                  if (a := row.get("judge_vs_contains"))]
    if agreements:
        lines.append("\njudge against contain-match, questions where they agree: " + "; ".join(agreements))
    served = served_line(report["strategies"])
    if served:
        lines.append(f"\n{served}")
    sanity = report.get("judge_sanity")
    if sanity and sanity["reference_accepted"] < sanity["asked"]:
        lines.append(f"\njudge: it accepted the reference answer itself for {sanity['reference_accepted']} of "
                     f"{sanity['asked']} questions, so its column measures the judge more than the answers")
    return "\n".join(lines) + "\n"


def served_line(strategies: dict[str, dict]) -> str:
    """Which models served each strategy's answers (one clause for all when they agree), and the answers recorded
    before records named their models; empty for rows without the record (metrics written before it).

    >>> served_line({"naive": {"served_by": {"generator": ["qwen"]}, "served_unrecorded": 0},
    ...              "lattice": {"served_by": {"generator": ["qwen"], "scorer": ["ce", "qwen"]},
    ...                          "served_unrecorded": 2}})
    'served by: naive: generator qwen; lattice: generator qwen, scorer ce and qwen (2 answers recorded before answers \
named their models)'
    >>> served_line({"bm25_floor": {"served_by": {}, "served_unrecorded": 0}})
    ''
    """
    def clause(row: dict) -> str:
        models = ", ".join(f"{role} {' and '.join(names)}" for role, names in row["served_by"].items())
        unrecorded = row["served_unrecorded"]
        if not unrecorded:
            return models
        before = f"{unrecorded} answers recorded before answers named their models"
        return f"{models} ({before})" if models else f"not recorded ({before})"

    # a strategy without model calls (bm25_floor) has nothing to name
    clauses = {name: text for name, row in strategies.items() if "served_by" in row and (text := clause(row))}
    if not clauses:
        return ""
    if len(clauses) > 1 and len(set(clauses.values())) == 1:
        return f"served by, every strategy: {next(iter(clauses.values()))}"
    return "served by: " + "; ".join(f"{name}: {text}" for name, text in clauses.items())


def _failed_cell(row: dict) -> str:
    """``failed/questions``, with the kinds when any failed.

    >>> _failed_cell({"n_questions": 30, "answered": 28, "failures": {"request_failed": 2}})
    '2/30 (request_failed 2)'
    """
    failed = f"{row['n_questions'] - row['answered']}/{row['n_questions']}"
    kinds = ", ".join(f"{kind} {n}" for kind, n in row.get("failures", {}).items())
    return f"{failed} ({kinds})" if kinds else failed


def _slates_cell(slates: dict | None) -> str:
    """``failed/slates`` for a tree search, ``-`` for a strategy without slates."""
    return "-" if slates is None else f"{slates['failed']}/{slates['slates']}"


def _cost_cell(check: dict | None) -> str:
    """``yes`` when every question's costs were checked and added up; ``yes (k/n)`` when a killed run left some
    unchecked."""
    if check is None:
        return "-"
    if not check["match"]:
        return "NO"
    checked, total = check["questions_checked"], check["questions"]
    return "yes" if checked == total else f"yes ({checked}/{total})"


def _score(value: float | None, interval, n: int | None = None) -> str:
    """A figure with its 95% interval (and its number of questions when given).

    >>> _score(0.25, [0.1, 0.4]), _score(0.5, None, 2), _score(None, None, 0)
    ('0.250 [0.10, 0.40]', '0.500 (n=2)', '- (n=0)')
    """
    cell = "-" if value is None else f"{value:.3f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
    return cell if n is None else f"{cell} (n={n})"


def pipeline_qasper_table(report: dict) -> str:
    """``eval pipeline`` metrics.json of a QASPER run: QASPER's own metrics per strategy (Answer F1 overall and by
    the answer type of the best-matching reference, Evidence F1 of the top chunks' paragraphs and of the cited
    passages' paragraphs, the cited one with the answers that fell back to the top chunks); "" for another dataset.

    >>> top = {"answer_f1": 0.5, "answer_f1_ci95": [0.2, 0.8], "evidence_f1": 0.25, "evidence_f1_ci95": None,
    ...        "answer_f1_by_type": {"extractive": {"answer_f1": 0.5, "n": 2, "ci95": None}}}
    >>> cited = {**top, "evidence_f1": 0.5, "citations": {"cited": 1, "fallback": 1}}
    >>> print(pipeline_qasper_table({"qasper": {"evidence_paragraphs": 1}, "strategies": {
    ...     "naive": {"qasper": {"top_chunks": top, "cited": cited}}, "bm25_floor": {"qasper": {"top_chunks": top}}}}))
    QASPER's metrics (Answer F1 by the type of the best-matching reference; Evidence F1 over paragraph strings, ...
    <BLANKLINE>
    | strategy | Answer F1 | extractive | abstractive | boolean | none | Evidence F1, top chunks | Evidence F1, cited |
    | --- | --- | --- | --- | --- | --- | --- | --- |
    | naive | 0.500 [0.20, 0.80] | 0.500 (n=2) | - (n=0) | - (n=0) | - (n=0) | 0.250 | 0.500 (fallback 1/2) |
    | bm25_floor | 0.500 [0.20, 0.80] | 0.500 (n=2) | - (n=0) | - (n=0) | - (n=0) | 0.250 | - |
    """
    if "qasper" not in report:
        return ""
    types = ("extractive", "abstractive", "boolean", "none")
    rows = []
    for name, row in report["strategies"].items():
        scores = row.get("qasper")
        if scores is None:
            continue
        top, cited = scores["top_chunks"], scores.get("cited")
        by_type = [top["answer_f1_by_type"].get(kind, {"answer_f1": None, "n": 0, "ci95": None}) for kind in types]
        cited_cell = "-"
        if cited is not None:
            counts = cited["citations"]
            cited_cell = (f"{_score(cited['evidence_f1'], cited['evidence_f1_ci95'])} (fallback "
                          f"{counts['fallback']}/{counts['cited'] + counts['fallback']})")
        rows.append([name, _score(top["answer_f1"], top["answer_f1_ci95"]),
                     *(_score(t["answer_f1"], t["ci95"], t["n"]) for t in by_type),
                     _score(top["evidence_f1"], top["evidence_f1_ci95"]), cited_cell])
    title = ("QASPER's metrics (Answer F1 by the type of the best-matching reference; Evidence F1 over paragraph "
             f"strings, at most {report['qasper']['evidence_paragraphs']} per answer)\n\n")
    return title + grid(["strategy", "Answer F1", *types, "Evidence F1, top chunks", "Evidence F1, cited"], rows)
