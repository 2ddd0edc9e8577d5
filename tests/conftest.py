"""Shared fixtures: caches point into the tree so tests never reach a hub (they are offline); the planner's
labels, traces and a short SFT adapter on real SQuAD questions, made once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("OVERSTORY_CACHE", str(ROOT / ".cache" / "overstory"))
os.environ.setdefault("HF_HOME", str(ROOT / ".cache" / "huggingface"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_DIR", str(ROOT / ".cache" / "wandb"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))  # DeepSpeed JIT ops
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))


SQUAD = ROOT / "data/squad/dev-v2.0-articles.json"


@pytest.fixture(scope="session")
def squad_chunks() -> list:
    """The hierarchy of the three shipped SQuAD articles (default settings), built once."""
    from overstory.data_pipeline.corpora import load_corpus
    from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies

    return build_hierarchies(load_corpus("squad", SQUAD)[0], HierarchyConfig())


def store_labels(path: Path, labels: list, chunks: list) -> Path:
    """Write pseudo-labels and, beside them, the hierarchy they refer to, as the pseudo-labels job does."""
    from overstory.data_pipeline.formats import write_jsonl
    from overstory.data_pipeline.hierarchy import save_hierarchies, stored_hierarchy_path

    write_jsonl(path, labels)
    save_hierarchies(stored_hierarchy_path(path), chunks)
    return path


@pytest.fixture(scope="session")
def planner_labels(tmp_path_factory, squad_chunks) -> Path:
    """Pseudo-labels for 24 real SQuAD questions over the three articles. The ranges are chosen here,
    cycling through four, so the planner tests see every level (the labelling job has its own test)."""
    from overstory.data_pipeline.corpora import load_corpus
    from overstory.data_pipeline.formats import PseudoLabel
    from overstory.data_pipeline.pseudo_labels import single_document_questions

    picked: dict[str, list] = {}
    for question, doc_id in single_document_questions(load_corpus("squad", SQUAD)[1]):
        picked.setdefault(doc_id, [])
        if len(picked[doc_id]) < 8:
            picked[doc_id].append((question, doc_id))
    ranges = [("sentence", "sentence"), ("sentence", "paragraph"), ("paragraph", "section"), ("sentence", "document")]
    labels = [PseudoLabel(q.id, d, q.question, q.answers, *ranges[i % len(ranges)], True, 1, [], [], q.answers[0],
                          "builtin:smollm2-135m-instruct", "contains", evidence=q.evidence)
              for i, (q, d) in enumerate(pair for pairs in picked.values() for pair in pairs)]
    return store_labels(tmp_path_factory.mktemp("planner") / "labels.jsonl", labels, squad_chunks)


@pytest.fixture(scope="session")
def planner_traces(planner_labels: Path) -> Path:
    """Template-teacher traces for ``planner_labels`` (a real traces run)."""
    from overstory.cli import main

    folder = planner_labels.parent
    assert main(["data", "traces", "--config", str(ROOT / "configs/data/traces.yaml"),
                 f"labels={planner_labels}", f"out={folder / 'traces.jsonl'}",
                 "teachers={template: {kind: template}}", "metadata_tokens=96", "tracking.backend=none"]) == 0
    return folder / "traces.jsonl"


@pytest.fixture(scope="session")
def sft_planner(planner_traces: Path, tmp_path_factory) -> Path:
    """A short real planner_sft run on the template traces with a high learning rate: a policy that writes the
    planner's format, so GRPO (in planner_grpo and STITCH) sees rewards that differ within a group. Its
    ``metrics.json`` keeps the loss per step."""
    from overstory.cli import main

    out = tmp_path_factory.mktemp("sft_planner") / "sft"
    code = main(["train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"),
                 f"traces={planner_traces}", f"out={out}", "train.max_steps=6", "train.batch_size=2", "train.lr=3e-3",
                 "train.warmup_ratio=0", "train.val_fraction=0", "train.max_length=384", "train.logging_steps=1",
                 "tracking.backend=none"])
    assert code == 0
    return out
