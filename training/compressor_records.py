"""Where ``overstory train compressor`` gets its records: summary records, or child groups made from the corpus.

With ``data`` (``overstory data summaries`` output) the records are ``SummaryRecord``s and the chunks they name come
from the hierarchy the summaries job stored beside them. With ``groups`` (no summaries: the contrastive objective
only) the ``questions`` corpus's own hierarchy is built and every upper-level chunk's children are embedded with the
run's encoder (``data_pipeline/compressor_groups.py``). That takes minutes on a CPU for all of QASPER's train
papers, so the groups, the upper-level chunks and the settings that made them are kept in the run's folder
(``groups.jsonl``, ``groups.hierarchy.jsonl``, ``groups.settings.json``): a resumed run reads them, and a run in the
same folder under other corpus, groups or encoder settings is refused. Under several processes the main one builds
them and the others read what it wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from accelerate import Accelerator

from overstory.core.config import to_dict
from overstory.core.records import Chunk, Document, SummaryRecord, read_jsonl, write_jsonl
from overstory.data_pipeline.compressor_groups import ChildGroup, GroupsConfig, child_groups, upper_chunks
from overstory.data_pipeline.corpora import CorpusConfig
from overstory.data_pipeline.hierarchy import (
    build_hierarchies,
    load_hierarchies,
    save_hierarchies,
    stored_hierarchy_path,
)
from overstory.models.registry import load_sentence_encoder

GROUPS_FILE = "groups.jsonl"
GROUPS_SETTINGS = "groups.settings.json"

Record = SummaryRecord | ChildGroup


def summary_records(data: str) -> tuple[list[SummaryRecord], dict[str, Chunk]]:
    """The summary records of ``data`` and the chunks the summaries job summarised, by id (stored beside it)."""
    records = list(read_jsonl(data, SummaryRecord))
    if not records:
        raise ValueError(f"{data} holds no summary records; run `overstory data summaries` first")
    return records, summary_chunks(data)


def summary_chunks(data: str) -> dict[str, Chunk]:
    """The chunks the summaries job summarised, by id (stored beside its output)."""
    path = stored_hierarchy_path(data)
    if not path.exists():
        raise ValueError(f"{path} not found: `overstory data summaries` stores the hierarchy it summarised there; "
                         f"rerun it (it resumes) to write it beside {data}")
    return {c.id: c for c in load_hierarchies(path)}


def groups_path(out: str) -> Path:
    """Where a run without summaries keeps the child groups it built."""
    return Path(out) / GROUPS_FILE


def stored_groups(out: str, corpus: CorpusConfig, documents: list[Document], groups: GroupsConfig, encoder: str,
                  accelerator: Accelerator) -> tuple[list[ChildGroup], dict[str, Chunk]]:
    """The child groups of ``documents``' upper levels and those upper-level chunks by id: read from ``out`` when
    an earlier run under the same settings built them, else built (by the main process) and kept there."""
    path, settings = groups_path(out), {"questions": to_dict(corpus), "groups": to_dict(groups), "encoder": encoder}
    settings_path = path.with_name(GROUPS_SETTINGS)
    if accelerator.is_main_process:
        if settings_path.exists() and path.exists():
            kept = json.loads(settings_path.read_text())
            if kept != settings:
                raise ValueError(f"{path} was built under other settings ({kept}); this run has {settings}: use "
                                 f"another out, or delete {path} to build the groups again")
        else:
            build_groups(path, documents, groups, encoder, accelerator)
            settings_path.write_text(json.dumps(settings, indent=2))  # last: its presence says the groups are whole
    accelerator.wait_for_everyone()
    chunks = {c.id: c for c in load_hierarchies(stored_hierarchy_path(path))}
    return list(read_jsonl(path, ChildGroup)), chunks


def build_groups(path: Path, documents: list[Document], groups: GroupsConfig, encoder: str,
                 accelerator: Accelerator) -> None:
    """Build the hierarchy of ``documents``, embed every upper-level chunk's children with ``encoder`` and write the
    groups to ``path``, their upper-level chunks beside it."""
    chunks = build_hierarchies(documents, groups.hierarchy)
    upper = upper_chunks(chunks, groups.levels)
    n_children = len({cid for c in upper for cid in c.children})
    accelerator.print(f"groups without summaries: embedding the {n_children} children of {len(upper)} "
                      f"{'/'.join(groups.levels)} chunks of {len(documents)} documents with {encoder}")
    model = load_sentence_encoder(encoder)
    made = child_groups(chunks, groups.levels, lambda texts: model.encode(
        texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False), encoder)
    save_hierarchies(stored_hierarchy_path(path), upper)
    write_jsonl(path, made)  # whole or not at all: a temporary file renamed into place
