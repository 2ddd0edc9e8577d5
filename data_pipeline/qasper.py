"""QASPER loader: NLP papers and the questions their readers asked, with evidence of every scope.

Reads the official layout (a ``train.json`` / ``dev.json`` file keyed by arXiv id, or a folder holding
them, also under the release names ``qasper-<split>-v0.3.json``) and the Hugging Face hub layout of
``allenai/qasper`` (columns of lists): a ``.jsonl`` file with one paper per line, or
``hub:allenai/qasper`` through ``datasets.load_dataset``. Both layouts give the same Documents and
questions.

Document (id ``qasper/<arXiv id>``, title = the paper's title, which is not in the text): the abstract
as a section headed "Abstract", then the paper's sections, headings on lines of their own and
blocks separated by blank lines. The structure goes into the metadata the hierarchy builder reads,
so that it rebuilds the paper's own levels: ``headings`` (``[depth, title, start, end]``: depth 1
for a section, 2 for ``A ::: B``, 3 for ``A ::: B ::: C``; the builder makes sections of depth 1
and subsections of depth 2, deeper parts stay inside their subsection) and ``paragraph_spans``. A
subsection whose parent section has no entry of its own gets that section's heading. Empty
paragraphs are skipped, and a section left with none is dropped (both counted); a paper without
sections is its abstract alone; a paper with no text at all is skipped with its questions.

Questions keep every annotator's answer in ``metadata["annotations"]``: its form (``extractive``,
``abstractive``, ``boolean`` or ``none`` = unanswerable, as QASPER's evaluator names them), the raw
fields and its evidence located in the text. The first annotation is the primary one: ``answers``
holds its reference string (extractive spans joined by ", ", the free-form answer, or "Yes"/"No",
as QASPER's evaluator builds them; none when unanswerable), ``evidence`` its paragraphs as spans and
``metadata["sentence_evidence"]`` its highlighted sentences as ``[start, end]``. A highlight that is a
whole paragraph counts as paragraph evidence. Evidence that is only a figure or table ("FLOAT
SELECTED: ..." strings) and evidence that is a section heading are kept as strings, not spans
(``metadata["figure_table_only"]`` flags questions whose primary evidence is only figures/tables).
Evidence not found verbatim is matched modulo whitespace, then fuzzily (``evidence_match``); below
the similarity threshold it gets no span and is counted as ``not_found``. ``read_qasper`` returns
the counts (``QasperReport``); ``load_qasper`` logs them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overstory.core.records import Document, QAExample, Span
from overstory.data_pipeline.corpus_files import SPLITS, CorpusError, Loaded, read_json, read_json_lines, require
from overstory.data_pipeline.evidence_match import Match, locate, match_paragraph
from overstory.data_pipeline.hub import hub_name, hub_rows

log = logging.getLogger(__name__)

FLOAT_PREFIX = "FLOAT SELECTED"  # how QASPER marks evidence that is a figure or table
HUB_SPLITS = {"train": "train", "dev": "validation", "test": "test"}  # official name -> hub name
OFFICIAL_SPLITS = {hub: official for official, hub in HUB_SPLITS.items()}
LOCAL_HINT = "a QASPER train.json / dev.json, a folder holding them, or a hub-layout .jsonl file"


@dataclass
class QasperReport:
    """What loading did that a reader should know: skipped text and how evidence was matched.
    ``evidence`` counts every annotation's evidence items by kind: ``paragraph/<how>`` and
    ``sentence/<how>`` (how = exact, whitespace, fuzzy, not_found), ``figure_table``, ``heading``."""

    papers: int = 0
    papers_without_sections: int = 0
    papers_skipped_empty: int = 0
    empty_paragraphs: int = 0
    empty_sections: int = 0
    questions: int = 0
    unanswerable: int = 0
    figure_table_only: int = 0
    evidence: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        counts = {k: v for k, v in vars(self).items() if k != "evidence"}
        return {**counts, "evidence": dict(sorted(self.evidence.items()))}


def load_qasper(path: Path, split: str = "") -> Loaded:
    """Documents and questions of QASPER at ``path`` (see the module docstring); logs the report."""
    documents, questions, report = read_qasper(path, split)
    log.info("QASPER %s: %s", path, json.dumps(report.as_dict()))
    return documents, questions


def read_qasper(path: Path, split: str = "") -> tuple[list[Document], list[QAExample], QasperReport]:
    """Documents, questions and the loading report of the QASPER papers at ``path``. ``split`` picks
    a split of a folder or of the hub ("" = every split found); a file is the split it holds."""
    if split and split not in SPLITS["qasper"]:
        raise CorpusError(f"{path}: unknown QASPER split {split!r}; splits are {', '.join(SPLITS['qasper'])}")
    report = QasperReport()
    documents, questions = [], []
    for split_name, paper_id, paper, where in _papers(path, split):
        doc = paper_document(paper_id, paper, where, report)
        if doc is None:
            report.papers_skipped_empty += 1
            log.warning("%s: paper %s has no text; skipped with its %d questions", where, paper_id, len(paper["qas"]))
            continue
        documents.append(doc)
        names = section_names(paper)
        for n, qa in enumerate(paper["qas"]):
            questions.append(paper_question(qa, doc, names, split_name, f"{where}: qas[{n}]", report))
    report.papers = len(documents)
    return documents, questions, report


def _papers(path: Path, split: str) -> Iterator[tuple[str, str, dict, str]]:
    """``(split, paper id, paper in the official layout, where)`` for every paper at ``path``."""
    name = hub_name(path)
    if name is not None:
        for split_name, row in hub_rows(name, HUB_SPLITS[split] if split else "", LOCAL_HINT):
            paper_id, paper = official_paper(row, f"{name}[{split_name}]")
            yield OFFICIAL_SPLITS.get(split_name, split_name), paper_id, paper, name
        return
    if path.is_dir():
        files = _split_files(path, split)
    elif split:
        raise CorpusError(f"{path}: split {split!r} applies to a folder or the hub; this path is one file")
    else:
        files = [("", path)]
    for split_name, file in files:
        if file.suffix == ".jsonl":
            yield from _hub_layout_file(file, split_name)
            continue
        raw = read_json(file)
        if not isinstance(raw, dict):
            raise CorpusError(f"{file}: expected an object keyed by arXiv id, got {type(raw).__name__}")
        split_name = split_name or _split_of(file)
        for paper_id, paper in raw.items():
            _check_paper(paper, f"{file}: {paper_id}")
            yield split_name, str(paper_id), paper, str(file)


def _split_of(file: Path) -> str:
    """The split a file's name says it holds (``dev.json``, ``qasper-dev-v0.3.json``), or ""."""
    return next((s for s in SPLITS["qasper"] if file.stem == s or file.stem.startswith(f"qasper-{s}")), "")


def _split_files(folder: Path, split: str) -> list[tuple[str, Path]]:
    found = []
    for name in ([split] if split else SPLITS["qasper"]):
        candidates = [folder / f"{name}.json", folder / f"qasper-{name}-v0.3.json"]
        file = next((c for c in candidates if c.is_file()), None)
        if file is not None:
            found.append((name, file))
        elif split:
            raise CorpusError(f"{folder}: no QASPER {split} file ({' or '.join(c.name for c in candidates)})")
    if not found:
        raise CorpusError(f"{folder} holds no QASPER split file (train.json, dev.json, test.json)")
    return found


def _hub_layout_file(file: Path, split: str) -> Iterator[tuple[str, str, dict, str]]:
    for n, row in read_json_lines(file):
        paper_id, paper = official_paper(row, f"{file}:{n}")
        yield split or _split_of(file), paper_id, paper, f"{file}:{n}"


def _check_paper(paper: Any, where: str) -> None:
    require(paper, ("title", "abstract", "full_text", "qas"), where)
    if not isinstance(paper["full_text"], list) or not isinstance(paper["qas"], list):
        raise CorpusError(f"{where}: 'full_text' and 'qas' must be lists")
    for s, section in enumerate(paper["full_text"]):
        require(section, ("section_name", "paragraphs"), f"{where}: full_text[{s}]")
        if not isinstance(section["paragraphs"], list) or not all(isinstance(p, str) for p in section["paragraphs"]):
            raise CorpusError(f"{where}: full_text[{s}].paragraphs must be a list of strings")
    for n, qa in enumerate(paper["qas"]):
        require(qa, ("question", "question_id", "answers"), f"{where}: qas[{n}]")
        for a, answer in enumerate(qa["answers"]):
            require(answer, ("answer",), f"{where}: qas[{n}].answers[{a}]")
            require(answer["answer"], ("unanswerable", "extractive_spans", "yes_no", "free_form_answer",
                                        "evidence", "highlighted_evidence"), f"{where}: qas[{n}].answers[{a}].answer")


def official_paper(row: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """A hub-layout row (``full_text``, ``qas`` and ``figures_and_tables`` as columns of lists) ->
    ``(id, paper)`` in the official layout (lists of records)."""
    require(row, ("id", "title", "abstract", "full_text", "qas"), where)
    try:
        full_text = [{"section_name": s, "paragraphs": p}
                     for s, p in zip(row["full_text"]["section_name"], row["full_text"]["paragraphs"], strict=True)]
        qas_columns = row["qas"]
        qas = [{"question": q, "question_id": i,
                "answers": [{"answer": a, "annotation_id": aid, "worker_id": wid}
                            for a, aid, wid in zip(ans["answer"], ans["annotation_id"], ans["worker_id"], strict=True)]}
               for q, i, ans in zip(qas_columns["question"], qas_columns["question_id"], qas_columns["answers"],
                                    strict=True)]
        floats = row.get("figures_and_tables") or {"caption": [], "file": []}
        figures = [{"file": f, "caption": c} for f, c in zip(floats["file"], floats["caption"], strict=True)]
    except (KeyError, TypeError, ValueError) as exc:
        raise CorpusError(f"{where}: not QASPER's hub layout ({type(exc).__name__}: {exc})") from exc
    paper = {"title": row["title"], "abstract": row["abstract"], "full_text": full_text, "qas": qas,
             "figures_and_tables": figures}
    _check_paper(paper, where)
    return str(row["id"]), paper


def _section_path(name: Any) -> list[str]:
    """``"A ::: B"`` -> ``["A", "B"]``; a missing name makes an untitled section."""
    parts = [p.strip() for p in str(name or "").split(":::") if p.strip()]
    return parts or ["(untitled section)"]


def section_names(paper: dict[str, Any]) -> set[str]:
    """Every way evidence may quote a heading: full names (``A ::: B``) and their parts."""
    names = {str(s["section_name"] or "").strip() for s in paper["full_text"]}
    return {n for n in names | {part for s in paper["full_text"] for part in _section_path(s["section_name"])} if n}


def paper_document(paper_id: str, paper: dict[str, Any], where: str, report: QasperReport) -> Document | None:
    """The paper as one Document with its headings and paragraph spans; None when it has no text."""
    pieces: list[str] = []
    headings: list[list] = []
    paragraph_spans: list[list[int]] = []
    offset = 0

    def add(piece: str) -> tuple[int, int]:
        nonlocal offset
        if pieces:
            offset += 2  # the "\n\n" between blocks
        pieces.append(piece)
        start, offset = offset, offset + len(piece)
        return start, offset

    if not paper["full_text"]:
        report.papers_without_sections += 1
    sections = [(["Abstract"], [paper["abstract"] or ""]),
                *((_section_path(s["section_name"]), s["paragraphs"]) for s in paper["full_text"])]
    open_path: list[str] = []
    for path, paragraphs in sections:
        kept = [p for p in paragraphs if p.strip()]
        report.empty_paragraphs += len(paragraphs) - len(kept)
        if not kept:
            report.empty_sections += 1
            continue
        if path != open_path:
            # headings from the first level where the path leaves the open one; a path that is a prefix of the
            # open one (A after A ::: B) repeats its last heading, so its paragraphs are not B's
            same = next((i for i, (a, b) in enumerate(zip(path, open_path)) if a != b), min(len(path), len(open_path)))
            same = min(same, len(path) - 1)
            for depth in range(same, len(path)):
                start, end = add(path[depth])
                headings.append([depth + 1, path[depth], start, end])
            open_path = path
        for paragraph in kept:
            paragraph_spans.append(list(add(paragraph)))
    if not paragraph_spans:
        return None
    figures = [{"file": f.get("file", ""), "caption": f.get("caption", "")}
               for f in paper.get("figures_and_tables") or []]
    return Document(f"qasper/{paper_id}", paper["title"] or paper_id, "\n\n".join(pieces),
                    {"headings": headings, "paragraph_spans": paragraph_spans, "paper_id": paper_id,
                     "figures_and_tables": figures})


def paragraphs_at(doc: Document, spans: Sequence[tuple[int, int]]) -> list[str]:
    r"""The paper's own paragraphs (verbatim, as in ``full_text``) that the character spans overlap, in the spans'
    order, each once. QASPER's evaluator scores evidence by exact string match against the gold paragraphs, so a
    sentence, a window or a section retrieved as evidence is scored through the paragraphs it touches.

    >>> doc = Document("qasper/x", "X", "Abstract\n\nOne. Two.\n\nThree.", {"paragraph_spans": [[10, 19], [21, 27]]})
    >>> paragraphs_at(doc, [(21, 27), (14, 25), (0, 8)])
    ['Three.', 'One. Two.']
    """
    found: list[str] = []
    for start, end in spans:
        for p_start, p_end in doc.metadata["paragraph_spans"]:
            text = doc.text[p_start:p_end]
            if p_start < end and start < p_end and text not in found:
                found.append(text)
    return found


def _answer_form(answer: dict[str, Any], where: str) -> tuple[str, str]:
    """``(form, reference string)`` of one annotation, as QASPER's evaluator reads it."""
    if answer["unanswerable"]:
        return "none", "Unanswerable"
    if answer["extractive_spans"]:
        return "extractive", ", ".join(answer["extractive_spans"])
    if answer["free_form_answer"]:
        return "abstractive", answer["free_form_answer"]
    if answer["yes_no"] is not None:
        return "boolean", "Yes" if answer["yes_no"] else "No"
    raise CorpusError(f"{where}: an annotation has no answer (not unanswerable, no spans, free form or yes/no)")


def _add_span(spans: list[list[int]], match: Match) -> None:
    if [match.start, match.end] not in spans:
        spans.append([match.start, match.end])


def _non_text(item: str, headings: set[str]) -> str | None:
    """``figure_table`` for QASPER's figure/table evidence, ``heading`` for a quoted section name (whole,
    or part of an ``A ::: B`` path, as highlights sometimes quote it), else None."""
    item = item.strip()
    if item.startswith(FLOAT_PREFIX):
        return "figure_table"
    if item in headings or (":::" in item and any(item in name for name in headings)):
        return "heading"
    return None


def _in_caption(item: str, doc: Document) -> bool:
    """A caption quoted without QASPER's float marker (some annotators selected the page itself)."""
    item = item.strip()
    return len(item) >= 10 and any(item in f["caption"] for f in doc.metadata["figures_and_tables"])


def locate_evidence(answer: dict[str, Any], doc: Document, headings: set[str], report: QasperReport) -> dict[str, Any]:
    """One annotation's evidence as spans of ``doc``: paragraphs and highlighted sentences; figure/table
    and heading items (``headings``: the paper's section names) stay strings, and items found nowhere
    are listed in ``not_found``. ``evidence_match`` counts how the text items matched."""
    paragraphs = [tuple(s) for s in doc.metadata["paragraph_spans"]]
    out: dict[str, Any] = {"evidence": [], "sentence_evidence": [], "figure_table_evidence": [],
                           "heading_evidence": [], "not_found": []}
    how = Counter()

    def text_item(kind: str, result: str) -> None:
        how[f"{kind}/{result}"] += 1
        report.evidence[f"{kind}/{result}"] += 1

    def non_text(item: str, kind: str | None) -> bool:
        if kind is not None:
            out[f"{kind}_evidence"].append(item.strip())
            report.evidence[kind] += 1
        return kind is not None

    for item in answer["evidence"]:
        found = match_paragraph(item, doc.text, paragraphs)
        if found and found[1].how != "fuzzy":  # verbatim text wins over a heading that reads the same
            text_item("paragraph", found[1].how)
            _add_span(out["evidence"], found[1])
        elif non_text(item, _non_text(item, headings)):
            continue
        elif found:
            text_item("paragraph", "fuzzy")
            _add_span(out["evidence"], found[1])
        elif not non_text(item, "figure_table" if _in_caption(item, doc) else None):
            text_item("paragraph", "not_found")
            out["not_found"].append(item)
    regions = sorted(tuple(s) for s in out["evidence"])
    for highlight in answer["highlighted_evidence"]:
        for line in highlight.splitlines():  # a highlight may run over a heading and paragraphs
            if not line.strip() or non_text(line, _non_text(line, headings)):
                continue
            match = locate(line, doc.text, regions, paragraphs)
            if match is None:
                if not non_text(line, "figure_table" if _in_caption(line, doc) else None):
                    text_item("sentence", "not_found")
                    out["not_found"].append(line)
                continue
            text_item("sentence", match.how)
            located = doc.text[match.start:match.end]
            whole = next((p for p in paragraphs if doc.text[p[0]:p[1]].strip() == located), None)
            if whole is not None:  # the highlight is a whole paragraph: paragraph evidence
                _add_span(out["evidence"], Match(whole[0], whole[1], match.how))
            else:
                _add_span(out["sentence_evidence"], match)
    out["evidence"].sort()
    out["sentence_evidence"].sort()
    out["evidence_match"] = dict(how)
    return out


def paper_question(qa: dict[str, Any], doc: Document, headings: set[str], split: str, where: str,
                   report: QasperReport) -> QAExample:
    """One question with every annotation kept; the first annotation gives ``answers`` and ``evidence``."""
    if not qa["answers"]:
        raise CorpusError(f"{where}: question {qa['question_id']} has no answers")
    annotations = []
    for a, entry in enumerate(qa["answers"]):
        answer = entry["answer"]
        form, reference = _answer_form(answer, f"{where}.answers[{a}]")
        annotations.append({
            "annotation_id": entry.get("annotation_id", ""), "worker_id": entry.get("worker_id", ""),
            "form": form, "reference": reference,
            **{k: answer[k] for k in ("unanswerable", "extractive_spans", "yes_no", "free_form_answer")},
            **locate_evidence(answer, doc, headings, report),
        })
    primary = annotations[0]
    unanswerable = primary["form"] == "none"
    figure_table_only = bool(primary["figure_table_evidence"]) and not (
        primary["evidence"] or primary["sentence_evidence"] or primary["not_found"])
    report.questions += 1
    report.unanswerable += unanswerable
    report.figure_table_only += figure_table_only
    return QAExample(
        id=str(qa["question_id"]), question=qa["question"], answers=[] if unanswerable else [primary["reference"]],
        evidence=[Span(doc.id, s, e) for s, e in primary["evidence"]], dataset="qasper",
        metadata={"doc_id": doc.id, "paper_id": doc.metadata["paper_id"], "split": split,
                  "answer_form": primary["form"], "unanswerable": unanswerable,
                  "figure_table_only": figure_table_only, "sentence_evidence": primary["sentence_evidence"],
                  "evidence_match": primary["evidence_match"],
                  "references": [a["reference"] for a in annotations if a["form"] != "none"],
                  "annotations": annotations},
    )

