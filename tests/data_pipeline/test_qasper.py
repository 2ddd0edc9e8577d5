"""The QASPER loader on the slice shipped in data/qasper: structure, evidence spans, answer forms, flags, both
layouts, and bad input (papers without sections, empty paragraphs, evidence that is not verbatim)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.data_pipeline.corpora import CorpusConfig, CorpusError, load_corpus
from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchy, chunks_at_levels
from overstory.data_pipeline.qasper import read_qasper

DATA = Path(__file__).resolve().parents[2] / "data" / "qasper"


def raw_papers(split: str) -> dict:
    return json.loads((DATA / f"{split}.json").read_text())


def by_id(questions: list) -> dict:
    return {q.id[:10]: q for q in questions}


def test_structure_of_a_known_paper(tokenizer) -> None:
    """1909.06708 has sections, ``A ::: B`` subsections (whose parent has no entry of its own: "Experiments") and
    ``A ::: B ::: C`` parts; the hierarchy rebuilt from the loader has the paper's sections and subsections."""
    documents, _ = load_corpus("qasper", DATA / "train.json")
    doc = {d.id: d for d in documents}["qasper/1909.06708"]
    raw = raw_papers("train")["1909.06708"]
    assert doc.title == raw["title"] and doc.text.startswith("Abstract\n\n" + raw["abstract"])
    headings = doc.metadata["headings"]
    sections = [h[1] for h in headings if h[0] == 1]
    subsections = [h[1] for h in headings if h[0] == 2]
    assert sections == ["Abstract", "Introduction", "Approach", "Experiments", "Conclusion", "Acknowledgment"]
    assert subsections == ["Observation: Illed States and Attentions", "Hints from the ART teacher Model",
                           "Experimental Settings", "Inference", "Experimental Results"]
    assert [h[1] for h in headings if h[0] == 3] == ["Hints from hidden states", "Hints from word alignments"]
    for _, title, start, end in headings:
        assert doc.text[start:end] == title
    paragraphs = [raw["abstract"], *(p for s in raw["full_text"] for p in s["paragraphs"])]
    assert len(doc.metadata["paragraph_spans"]) == len(paragraphs) == 31
    assert [doc.text[s:e] for s, e in doc.metadata["paragraph_spans"]] == paragraphs

    chunks = build_hierarchy(doc, tokenizer, HierarchyConfig())
    section_chunks = chunks_at_levels(chunks, "section")
    assert [c.text.split("\n\n")[0] for c in section_chunks] == sections  # one section chunk per section, in order
    heads = {h[2]: h[1] for h in headings if h[0] == 2}
    experiments = section_chunks[3]
    sub_chunks = [c for c in chunks_at_levels(chunks, "subsection") if c.parent == experiments.id]
    assert [heads.get(c.start) for c in sub_chunks] == ["Experimental Settings", "Inference", "Experimental Results"]
    approach = section_chunks[2]  # its own paragraph before the first subsection makes a subsection too
    assert [heads.get(c.start) for c in chunks_at_levels(chunks, "subsection") if c.parent == approach.id] == [
        None, "Observation: Illed States and Attentions", "Hints from the ART teacher Model"]
    assert len(chunks_at_levels(chunks, "paragraph")) == 31


def test_every_paper_keeps_its_paragraphs_in_order() -> None:
    for split in ("dev", "train"):
        documents, _ = load_corpus(CorpusConfig("qasper", str(DATA), split=split))
        raw = raw_papers(split)
        assert [d.metadata["paper_id"] for d in documents] == list(raw)
        for doc in documents:
            paper = raw[doc.metadata["paper_id"]]
            kept = [paper["abstract"], *(p for s in paper["full_text"] for p in s["paragraphs"] if p.strip())]
            assert [doc.text[s:e] for s, e in doc.metadata["paragraph_spans"]] == kept


def test_evidence_spans_reproduce_the_evidence() -> None:
    for split in ("dev", "train"):
        documents, questions = load_corpus("qasper", DATA / f"{split}.json")
        docs = {d.id: d for d in documents}
        raw = {q["question_id"]: q for p in raw_papers(split).values() for q in p["qas"]}
        checked = 0
        for q in questions:
            text = docs[q.metadata["doc_id"]].text
            paragraphs = {text[s:e] for s, e in docs[q.metadata["doc_id"]].metadata["paragraph_spans"]}
            assert q.evidence == sorted(q.evidence, key=lambda s: (s.start, s.end))
            assert [[s.start, s.end] for s in q.evidence] == q.metadata["annotations"][0]["evidence"]
            for annotation, entry in zip(q.metadata["annotations"], raw[q.id]["answers"], strict=True):
                spans = {text[s:e] for s, e in annotation["evidence"]}
                for paragraph in entry["answer"]["evidence"]:
                    if paragraph in paragraphs:
                        assert paragraph in spans  # a verbatim evidence paragraph is exactly one of the spans
                        checked += 1
                highlights = "\n".join(entry["answer"]["highlighted_evidence"])
                for s, e in annotation["sentence_evidence"]:
                    assert text[s:e] in highlights or annotation["evidence_match"].get("fuzzy")
        assert checked > 20


def test_whitespace_variants_and_highlights_that_are_whole_paragraphs() -> None:
    """1604.05559's "old method" question quotes two paragraphs without their trailing space (found modulo
    whitespace) and highlights whole paragraphs, which count as paragraph evidence, not sentences."""
    documents, questions = load_corpus("qasper", DATA / "dev.json")
    q = by_id(questions)["6014c2219d"]
    # highlights are matched line by line: 5 lines, each a whole paragraph (one without its trailing space)
    assert q.metadata["evidence_match"] == {"paragraph/exact": 3, "paragraph/whitespace": 2, "sentence/exact": 4,
                                            "sentence/whitespace": 1}
    text = documents[2].text
    assert text[q.evidence[0].start:q.evidence[0].end] == "Bigram frequencies are often calculated using the " \
                                                          "approximation "
    assert len(q.evidence) == 5 and q.metadata["sentence_evidence"] == []


def test_every_answer_form_and_the_unanswerable_flag() -> None:
    _, questions = load_corpus("qasper", DATA / "dev.json")
    forms = {q.metadata["answer_form"] for q in questions}
    assert forms == {"extractive", "abstractive", "boolean", "none"}
    raw = {q["question_id"]: q for p in raw_papers("dev").values() for q in p["qas"]}
    for q in questions:
        primary = raw[q.id]["answers"][0]["answer"]
        form = q.metadata["answer_form"]
        if form == "extractive":
            assert q.answers == [", ".join(primary["extractive_spans"])]
        elif form == "abstractive":
            assert q.answers == [primary["free_form_answer"]]
        elif form == "boolean":
            assert q.answers == (["Yes"] if primary["yes_no"] else ["No"])
        else:
            assert q.answers == [] and q.evidence == [] and q.metadata["unanswerable"] and primary["unanswerable"]
        assert len(q.metadata["annotations"]) == len(raw[q.id]["answers"])  # every annotator kept
        for annotation, entry in zip(q.metadata["annotations"], raw[q.id]["answers"], strict=True):
            assert annotation["worker_id"] == entry["worker_id"]
            assert {k: annotation[k] for k in ("extractive_spans", "yes_no", "free_form_answer", "unanswerable")} == {
                k: entry["answer"][k] for k in ("extractive_spans", "yes_no", "free_form_answer", "unanswerable")}
    unanswerable = by_id(questions)["c626637ed1"]
    assert unanswerable.metadata["unanswerable"] and unanswerable.answers == []
    assert sum(q.metadata["unanswerable"] for q in questions) == 2


def test_figure_and_table_evidence_is_flagged_not_spanned() -> None:
    _, questions = load_corpus("qasper", DATA / "dev.json")
    q = by_id(questions)["049415676f"]  # its only evidence: "FLOAT SELECTED: Table 1. Evaluation results ..."
    assert q.metadata["figure_table_only"] and q.evidence == [] and q.metadata["sentence_evidence"] == []
    assert q.answers == ["F-1 score was improved by 1.19 percent points."]
    assert q.metadata["annotations"][0]["figure_table_evidence"][0].startswith("FLOAT SELECTED: Table 1.")
    assert [x.id[:10] for x in questions if x.metadata["figure_table_only"]] == ["049415676f"]


def to_hub_row(paper_id: str, paper: dict) -> dict:
    """An official-layout paper in the hub's layout (columns of lists), as allenai/qasper has it."""
    return {
        "id": paper_id, "title": paper["title"], "abstract": paper["abstract"],
        "full_text": {"section_name": [s["section_name"] for s in paper["full_text"]],
                      "paragraphs": [s["paragraphs"] for s in paper["full_text"]]},
        "qas": {key: [q[key] for q in paper["qas"]] for key in ("question", "question_id")}
        | {"answers": [{"answer": [a["answer"] for a in q["answers"]],
                        "annotation_id": [a["annotation_id"] for a in q["answers"]],
                        "worker_id": [a["worker_id"] for a in q["answers"]]} for q in paper["qas"]]},
        "figures_and_tables": {"caption": [f["caption"] for f in paper["figures_and_tables"]],
                               "file": [f["file"] for f in paper["figures_and_tables"]]},
    }


def test_hub_layout_gives_the_same_documents_and_questions(tmp_path: Path) -> None:
    """The hub sample's papers are in neither train.json nor dev.json, so the official dev papers are written
    in the hub layout here and both loaders must agree on them."""
    sample_ids = {json.loads(line)["id"] for line in (DATA / "hf_layout_sample.jsonl").read_text().splitlines()}
    assert not sample_ids & set(raw_papers("train")) and not sample_ids & set(raw_papers("dev"))
    hub = tmp_path / "dev.jsonl"
    hub.write_text("".join(json.dumps(to_hub_row(i, p)) + "\n" for i, p in raw_papers("dev").items()))
    official = read_qasper(DATA / "dev.json")
    converted = read_qasper(hub)
    assert converted[0] == official[0] and converted[1] == official[1]
    assert converted[2] == official[2]


def test_hub_sample_structure() -> None:
    """The real hub-layout lines: every paragraph kept in order, headings where the section names say,
    evidence spans reproduce the evidence, empty paragraphs skipped and counted."""
    rows = [json.loads(line) for line in (DATA / "hf_layout_sample.jsonl").read_text().splitlines()]
    documents, questions, report = read_qasper(DATA / "hf_layout_sample.jsonl")
    assert [d.id for d in documents] == [f"qasper/{r['id']}" for r in rows]
    for doc, row in zip(documents, rows, strict=True):
        paragraphs = [p for ps in row["full_text"]["paragraphs"] for p in ps]
        kept = [row["abstract"], *(p for p in paragraphs if p.strip())]
        assert [doc.text[s:e] for s, e in doc.metadata["paragraph_spans"]] == kept
        with_text = [n for n, ps in zip(row["full_text"]["section_name"], row["full_text"]["paragraphs"], strict=True)
                     if any(p.strip() for p in ps)]  # a section's ancestors get headings even without entries
        assert {h[1] for h in doc.metadata["headings"]} == {part for n in with_text for part in n.split(" ::: ")} | {
            "Abstract"}
        assert len(questions_of(questions, doc.id)) == len(row["qas"]["question"])
    assert report.empty_paragraphs == sum(1 for r in rows for ps in r["full_text"]["paragraphs"] for p in ps
                                          if not p.strip()) > 0
    assert max(h[0] for h in documents[1].metadata["headings"]) == 3  # 1909.00694: A ::: B ::: C
    q = by_id(questions)["753990d0b6"]  # "What is the seed lexicon?": one paragraph, one highlighted sentence
    text = documents[1].text
    assert text[q.evidence[0].start:q.evidence[0].end].startswith("The seed lexicon consists of positive")
    # its second highlight is the fragment "It is a ", found nowhere: counted, no span
    assert q.metadata["annotations"][0]["not_found"] == ["It is a "] and report.evidence["sentence/not_found"] == 1


def questions_of(questions: list, doc_id: str) -> list:
    return [q for q in questions if q.metadata["doc_id"] == doc_id]


def test_offline_hub_error_says_what_to_pass() -> None:
    with pytest.raises(CorpusError, match=r"could not load 'allenai/qasper' from the Hugging Face hub.*pass the "
                                          r"dataset's official files instead: a QASPER train.json / dev.json"):
        load_corpus(CorpusConfig("qasper", "hub:allenai/qasper", split="dev"))


def test_splits_of_a_folder_and_config_errors(tmp_path: Path) -> None:
    documents, questions = load_corpus(CorpusConfig("qasper", str(DATA)))
    assert len(documents) == 8 and {q.metadata["split"] for q in questions} == {"dev", "train"}
    documents, questions = load_corpus(CorpusConfig("qasper", str(DATA), split="train"))
    assert [d.metadata["paper_id"] for d in documents] == ["1607.00167", "1909.06708"]
    with pytest.raises(ConfigError, match="corpus.split: 'validation' is not a qasper split; splits are train, dev"):
        CorpusConfig("qasper", str(DATA), split="validation")
    with pytest.raises(ConfigError, match="corpus.split applies to qasper, narrativeqa only, not 'squad'"):
        CorpusConfig("squad", "x.json", split="dev")
    with pytest.raises(CorpusError, match="this path is one file"):
        load_corpus("qasper", DATA / "dev.json", split="dev")
    with pytest.raises(CorpusError, match="no QASPER test file"):
        load_corpus("qasper", DATA, split="test")
    (tmp_path / "dev.json").write_text('{"1": {"title": "t"}}')
    with pytest.raises(CorpusError, match=r"dev.json: 1: missing field\(s\) abstract, full_text, qas"):
        load_corpus("qasper", tmp_path)


def paper(full_text: list, qas: list | None = None, abstract: str = "We study chunking.") -> dict:
    return {"title": "A paper", "abstract": abstract, "full_text": full_text, "qas": qas or [],
            "figures_and_tables": []}


def test_papers_without_sections_or_with_empty_paragraphs(tmp_path: Path) -> None:
    papers = {
        "no-sections": paper([]),
        "empty-paragraphs": paper([{"section_name": "Intro", "paragraphs": ["", "First.", "  \n", "Second."]},
                                   {"section_name": "Empty", "paragraphs": ["", " "]},
                                   {"section_name": "Intro ::: Part", "paragraphs": ["Third."]}]),
        "no-text": paper([{"section_name": "Intro", "paragraphs": [""]}], abstract=""),
    }
    papers["no-text"]["qas"] = [{"question": "?", "question_id": "lost", "answers": []}]
    (tmp_path / "train.json").write_text(json.dumps(papers))
    documents, questions, report = read_qasper(tmp_path / "train.json")
    assert [d.id for d in documents] == ["qasper/no-sections", "qasper/empty-paragraphs"] and questions == []
    assert documents[0].text == "Abstract\n\nWe study chunking." and len(documents[0].metadata["paragraph_spans"]) == 1
    doc = documents[1]
    assert doc.text == "Abstract\n\nWe study chunking.\n\nIntro\n\nFirst.\n\nSecond.\n\nPart\n\nThird."
    assert [h[:2] for h in doc.metadata["headings"]] == [[1, "Abstract"], [1, "Intro"], [2, "Part"]]
    assert (report.papers_without_sections, report.papers_skipped_empty, report.empty_paragraphs,
            report.empty_sections) == (1, 1, 6, 3)  # the skipped paper's empty abstract and paragraph count too


def test_evidence_not_found_verbatim_is_matched_fuzzily_or_counted(tmp_path: Path) -> None:
    """Real evidence of 1909.06708, altered: a typo (fuzzy), doubled spaces (whitespace), nonsense (not found)."""
    papers = copy.deepcopy({"1909.06708": raw_papers("train")["1909.06708"]})
    qa = next(q for q in papers["1909.06708"]["qas"] if q["question_id"].startswith("92fc94a499"))
    answer = qa["answers"][0]["answer"]
    first, second = answer["evidence"]
    answer["evidence"] = [first.replace("widely used", "widley used"), second.replace(" ", "  "),
                          "Colourless green ideas sleep furiously in the attention layers."]
    answer["highlighted_evidence"] = [first[:120].replace("machine", "machnie"), "zebra crossings on the moon"]
    (tmp_path / "train.json").write_text(json.dumps(papers))
    documents, questions, report = read_qasper(tmp_path / "train.json")
    q = by_id(questions)["92fc94a499"]
    text = documents[0].text
    assert q.metadata["evidence_match"] == {"paragraph/fuzzy": 1, "paragraph/whitespace": 1,
                                            "paragraph/not_found": 1, "sentence/fuzzy": 1, "sentence/not_found": 1}
    assert [text[s.start:s.end] for s in q.evidence] == [first, second]  # the paragraphs they came from
    (s, e), = q.metadata["sentence_evidence"]
    assert text[s:e] == first[:120]
    assert q.metadata["annotations"][0]["not_found"] == [
        "Colourless green ideas sleep furiously in the attention layers.", "zebra crossings on the moon"]
    assert report.evidence["paragraph/fuzzy"] == 1 and report.evidence["paragraph/not_found"] == 1
    assert report.evidence["sentence/fuzzy"] == 1 and report.evidence["sentence/not_found"] == 1
