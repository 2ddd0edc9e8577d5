"""Regenerate the QASPER and NarrativeQA slices shipped in data/ from the team's full copies.

    python scripts/make_data_slices.py                  # reads ../shared/data, writes data/
    python scripts/make_data_slices.py --source DIR --dest DIR

The papers and summaries are named below, with what each one brings to the tests; the files are
written in the official layouts (QASPER: compact JSON keyed by arXiv id, hub-layout lines copied as
they are; NarrativeQA: the three CSV files filtered by document id, plus its licence and the
Wikipedia attribution). Running it twice gives the same bytes. The README.md of each slice is
written by hand and left alone.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Chosen (the smallest papers that together cover every case) from the gold labels of the full sets.
QASPER_PAPERS = {
    "dev": [
        "2003.03728",  # subsections; figure/table-only and unanswerable questions; paragraph..paragraph
        "1706.04206",  # every answer form (extractive, abstractive, yes/no, none); evidence over several sections
        "1604.05559",  # several paragraphs of one section (paragraph..subsection and paragraph..section)
        "1910.01108",  # a highlighted sentence without its paragraph (sentence..sentence)
        "2001.05540",  # sentence..section; yes/no answers
        "2003.11528",  # evidence across sections (paragraph..document, sentence..document)
    ],
    "train": [
        "1607.00167",  # evidence across sections; unanswerable
        "1909.06708",  # subsections, figure/table-only, every answer form
    ],
}
# Two papers of hf_layout_sample.jsonl (QASPER's hub layout; none of its papers is in train.json or dev.json):
# the smallest, and one with subsections three levels deep.
QASPER_HUB_PAPERS = ["1810.04528", "1909.00694"]
# The first five summaries of documents.csv (films and books), and one whose stray quote marks make pysbd
# return a 500-word "sentence" (the loader splits it again). The shared copy holds the test set only.
NARRATIVEQA_DOCUMENTS = [
    "0025577043f5090cd603c6aea60f26e236195594",
    "014de1a8802c05ff64efa047e9290fb7fccea2b4",
    "019a9611dd8e1b822bd0a58f075cc4a30bdd0797",
    "020773a0ca71155173ec4affe6a2496a6cb45216",
    "0269408ac78193a0e13f1033bec6f658b00437b3",
    "f7bb9eb9306b79cad4b6466f2ac3dcbd0e5fa63a",
]


def qasper_slice(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for split, ids in QASPER_PAPERS.items():
        papers = json.loads((source / f"{split}.json").read_text(encoding="utf-8"))
        missing = [i for i in ids if i not in papers]
        if missing:
            raise SystemExit(f"{source / f'{split}.json'}: papers not found: {', '.join(missing)}")
        (dest / f"{split}.json").write_text(json.dumps({i: papers[i] for i in ids}, ensure_ascii=False),
                                            encoding="utf-8")
    lines = {json.loads(line)["id"]: line for line in
             (source / "hf_layout_sample.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()}
    (dest / "hf_layout_sample.jsonl").write_text("".join(lines[i] + "\n" for i in QASPER_HUB_PAPERS),
                                                 encoding="utf-8")


def _filter_csv(source: Path, dest: Path, keep: list[str]) -> None:
    """The header and the rows of ``keep``'s documents, in the order of ``keep`` (file order within one)."""
    with source.open(encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [row for row in reader if row["document_id"] in keep]
        fields = reader.fieldnames
    rows.sort(key=lambda row: keep.index(row["document_id"]))
    missing = set(keep) - {row["document_id"] for row in rows}
    if missing:
        raise SystemExit(f"{source}: documents not found: {', '.join(sorted(missing))}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def narrativeqa_slice(source: Path, dest: Path) -> None:
    summaries = Path("third_party") / "wikipedia" / "summaries.csv"
    for name in ("documents.csv", "qaps.csv", summaries):
        _filter_csv(source / name, dest / name, NARRATIVEQA_DOCUMENTS)
    for name in ("LICENSE.narrativeqa", "ATTRIBUTION.wikipedia"):
        shutil.copyfile(source / name, dest / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--dest", type=Path, default=ROOT / "data")
    args = parser.parse_args()
    qasper_slice(args.source / "qasper", args.dest / "qasper")
    narrativeqa_slice(args.source / "narrativeqa", args.dest / "narrativeqa")
    total = sum(p.stat().st_size for folder in ("qasper", "narrativeqa")
                for p in (args.dest / folder).rglob("*") if p.is_file())
    print(f"slices written to {args.dest}/qasper and {args.dest}/narrativeqa: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
