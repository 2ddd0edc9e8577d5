"""`overstory eval rag`: plain retrieve-then-generate, the baseline every strategy is compared with; it is
``overstory eval pipeline`` with the naive strategy only.

    overstory eval rag --config configs/eval/rag.yaml

The config holds what the naive strategy and the harness use (the ``naive`` index and levels, the ``answer``
prompt settings, the questions, the stack); the harness does the rest: one record per question appended as it
is answered (a failed request is recorded, never loses the run; a killed run resumes), exact match, token F1,
contain-match, ROUGE-L and recall@k with 95% intervals, costs per question checked against the server's counters,
failures and repairs by kind. Writes what ``eval pipeline`` writes (``metrics.json``, ``table.md``,
``predictions/naive.jsonl``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overstory.core.tracking import TrackingConfig
from overstory.data_pipeline.corpora import CorpusConfig
from overstory.data_pipeline.hierarchy import HierarchyConfig
from overstory.evaluation.pipeline import DATASETS, PipelineEvalConfig
from overstory.evaluation.pipeline import run as run_pipeline
from overstory.retrieval.naive import AnswerConfig, NaiveConfig
from overstory.serving.config import ServeConfig


@dataclass(frozen=True)
class RagEvalConfig:
    data: str = ""  # a shipped sample by name (hotpotqa, squad, qasper, narrativeqa); empty: the corpus section
    corpus: CorpusConfig = field(default_factory=lambda: DATASETS["hotpotqa"])
    limit_questions: int = 0  # 0 = all
    skip_unanswerable: bool = True
    # auto: each question searched in its own document where the dataset asks about one (QASPER, NarrativeQA,
    # SQuAD), the whole corpus for HotpotQA; corpus: always the whole corpus; document: always the question's own
    scope: str = "auto"
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)
    naive: NaiveConfig = field(default_factory=NaiveConfig)
    answer: AnswerConfig = field(default_factory=AnswerConfig)
    recall_k: int = 5
    concurrency: int = 2
    resume: bool = True
    request_timeout_s: float = 600.0
    max_failure_share: float = 0.0  # exit 1 past this share of questions unanswered for the harness's reasons
    server_url: str = ""  # a running stack; empty starts `serve` in the background (on a free port)
    serve: ServeConfig = field(default_factory=lambda: ServeConfig.local(port=0))
    out: str = "runs/eval/rag"
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        self.pipeline()  # the harness's own checks, naming their keys

    def pipeline(self) -> PipelineEvalConfig:
        """The harness's config for this run: the naive strategy, these settings, every other section unused."""
        return PipelineEvalConfig(
            strategies="naive", data=self.data, corpus=self.corpus, limit_questions=self.limit_questions,
            skip_unanswerable=self.skip_unanswerable, scope=self.scope, hierarchy=self.hierarchy, answer=self.answer,
            naive=self.naive,
            recall_k=self.recall_k, concurrency=self.concurrency, resume=self.resume,
            request_timeout_s=self.request_timeout_s, max_failure_share=self.max_failure_share,
            server_url=self.server_url, serve=self.serve, out=self.out,
            tracking=self.tracking)


def run(config: RagEvalConfig) -> dict:
    """``eval pipeline`` with the naive strategy; its report (the naive row under ``strategies``)."""
    return run_pipeline(config.pipeline())
