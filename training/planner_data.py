"""What the planner's RL recipes share: prompts with their labels, the reward set, the policy to train.

``planner_rows`` turns correct pseudo-labels into GRPO rows: the planner's chat prompt (question plus
the document's beginning) and the columns the rewards read (``example_id``, ``level_min``,
``level_max``, ``level_tokens``), split by document. ``build_rewards`` returns the reward functions of
``training/rewards.py`` with nonzero weight and their weights, in GRPOConfig's order.
``make_qa_judge`` is R_QA's backend: SmartChunk retrieval over the predicted range of the question's
document plus the generator, judged by the pseudo-labels' correctness rule. ``load_policy`` loads a
base model, a full checkpoint, or a planner_sft LoRA adapter (kept trainable).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.corpora import CorpusConfig, load_corpus
from data_pipeline.formats import LEVELS, Chunk, PseudoLabel, read_jsonl
from data_pipeline.hierarchy import HierarchyConfig, build_hierarchies, cached_tokenizer
from data_pipeline.pseudo_labels import CorrectnessConfig, is_correct
from data_pipeline.splits import split_by_document
from models.planner import document_metadata, planner_messages
from models.registry import load_causal_lm
from overstory.config import ConfigError
from retrieval.answer import clean_answer
from retrieval.smartchunk import DocumentRetrievers
from serving.client import Client
from training.rewards import QAReward, align_reward, format_reward, make_cost_reward, make_length_reward


@dataclass(frozen=True)
class PlannerDataConfig:
    labels: str  # pseudo-label JSONL; only correct labels become training prompts
    corpus: CorpusConfig
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    metadata_tokens: int = 1000  # how much of the document the planner reads
    val_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {self.val_fraction}")


@dataclass(frozen=True)
class RewardSettings:
    """Weights of R = gamma*R_format + beta*R_length + w_align*R_align + alpha*R_cost + w_qa*R_QA (0 drops a term)."""

    format: float = 1.0
    length: float = 0.01
    align: float = 1.0
    cost: float = 0.0
    qa: float = 0.0  # needs the generator; each (question, range) is answered once and cached
    max_completion_tokens: int = 128  # L_max of R_length
    k: int = 5  # chunks read per question (R_cost and R_QA)


def level_token_means(chunks: list[Chunk]) -> dict[str, dict[str, float]]:
    """Per document, the mean chunk length (tokens) of each level; a level a document lacks gets the
    next larger level's mean (its chunks would be read instead)."""
    sums: dict[str, dict[str, list[int]]] = {}
    for chunk in chunks:
        sums.setdefault(chunk.doc_id, {}).setdefault(chunk.level, []).append(chunk.n_tokens)
    means: dict[str, dict[str, float]] = {}
    for doc_id, by_level in sums.items():
        row: dict[str, float] = {}
        for level in reversed(LEVELS):
            values = by_level.get(level)
            row[level] = sum(values) / len(values) if values else row.get(LEVELS[min(LEVELS.index(level) + 1, 4)], 1.0)
        means[doc_id] = {level: row[level] for level in LEVELS}
    return means


def planner_rows(config: PlannerDataConfig, tokenizer_name: str) -> tuple[list[dict], list[dict], list[Chunk]]:
    """(train rows, validation rows, the hierarchy) from the correct pseudo-labels, split by document."""
    labels = [label for label in read_jsonl(config.labels, PseudoLabel) if label.correct]
    if not labels:
        raise ValueError(f"{config.labels} holds no correct pseudo-labels; run `overstory data pseudo-labels`")
    documents = {d.id: d for d in load_corpus(config.corpus)[0]}
    needed = {label.doc_id for label in labels}
    missing = sorted(needed - set(documents))
    if missing:
        raise ValueError(f"{len(missing)} labelled documents (e.g. {missing[0]}) are not in the corpus")
    chunks = build_hierarchies([documents[d] for d in sorted(needed)], config.hierarchy)
    tokens = level_token_means(chunks)
    tokenizer = cached_tokenizer(tokenizer_name)
    metadata = {d: document_metadata(documents[d].title, documents[d].text, tokenizer, config.metadata_tokens)
                for d in needed}
    train, val = split_by_document(labels, config.val_fraction) if config.val_fraction else (labels, [])

    def row(label: PseudoLabel) -> dict:
        return {"prompt": planner_messages(label.question, metadata[label.doc_id]), "example_id": label.id,
                "doc_id": label.doc_id, "question": label.question, "answers": label.answers,
                "level_min": label.level_min, "level_max": label.level_max, "level_tokens": tokens[label.doc_id],
                "gold_level_min": label.gold_level_min or "", "gold_level_max": label.gold_level_max or ""}

    return [row(label) for label in train], [row(label) for label in val], chunks


def make_qa_judge(rows: list[dict], chunks: list[Chunk], client: Client, correctness: CorrectnessConfig,
                  k: int, max_answer_tokens: int = 24) -> Callable[[str, str, str], bool]:
    """answer_correct(example_id, level_min, level_max) for ``QAReward``."""
    by_id = {r["example_id"]: r for r in rows}
    retrievers = DocumentRetrievers(chunks, client)

    def answer_correct(example_id: str, level_min: str, level_max: str) -> bool:
        example = by_id[example_id]
        reply, _ = retrievers[example["doc_id"]].answer(example["question"], level_min, level_max, k=k,
                                                        max_tokens=max_answer_tokens)
        return is_correct(clean_answer(reply.text), example["answers"], example["question"], correctness, client)

    return answer_correct


def build_rewards(settings: RewardSettings, qa_judge: Callable[[str, str, str], bool] | None = None
                  ) -> tuple[list[Callable], list[float]]:
    """The reward functions with nonzero weight, and the weights (GRPOConfig.reward_weights order)."""
    candidates = [(settings.format, format_reward),
                  (settings.length, make_length_reward(settings.max_completion_tokens)),
                  (settings.align, align_reward), (settings.cost, make_cost_reward(settings.k))]
    if settings.qa:
        if qa_judge is None:
            raise ConfigError("rewards.qa > 0 needs the generator for R_QA (a served stack)")
        candidates.append((settings.qa, QAReward(qa_judge)))
    chosen = [(weight, fn) for weight, fn in candidates if weight]
    if not chosen:
        raise ConfigError("rewards: every weight is 0; give at least one reward a weight")
    return [fn for _, fn in chosen], [weight for weight, _ in chosen]


def load_policy(name: str, dtype=None):
    """(model, tokenizer, base model name). A planner_sft adapter folder is loaded on its base, trainable."""
    folder = Path(name)
    if (folder / "adapter_config.json").exists():
        from peft import PeftModel

        manifest = folder / "overstory.json"
        base = json.loads(manifest.read_text())["base_model"] if manifest.exists() else \
            json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        model, tokenizer = load_causal_lm(base, **({"dtype": dtype} if dtype else {}))
        return PeftModel.from_pretrained(model, folder, is_trainable=True), tokenizer, base
    model, tokenizer = load_causal_lm(name, **({"dtype": dtype} if dtype else {}))
    return model, tokenizer, name
