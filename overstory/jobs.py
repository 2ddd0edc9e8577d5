"""The job table: which module, config class and run function each ``overstory`` subcommand runs.

Module paths are strings so that listing the jobs (``overstory --help``) imports none of them.
"""

from __future__ import annotations

import importlib

# (group, name) -> (module, config class, run function, description); "serve" and "quickstart" have one job.
JOBS: dict[tuple[str, str], tuple[str, str, str, str]] = {
    ("data", "hierarchy"): (
        "overstory.data_pipeline.hierarchy_job", "HierarchyJobConfig", "run",
        "build multi-level chunk hierarchies for a corpus; print per-level counts and token statistics",
    ),
    ("data", "summaries"): (
        "overstory.data_pipeline.summaries", "SummariesConfig", "run",
        "LLM summaries of upper-level chunks plus child and summary embeddings (compressor training data)",
    ),
    ("data", "pseudo-labels"): (
        "overstory.data_pipeline.pseudo_labels", "PseudoLabelsConfig", "run",
        "planner labels: retrieve over all levels, answer with the backbone, expand until correct",
    ),
    ("data", "traces"): (
        "overstory.data_pipeline.traces", "TracesConfig", "run",
        "planner reasoning traces that justify each pseudo-label, from a pool of teachers; yield per teacher",
    ),
    ("data", "gold-labels"): (
        "overstory.data_pipeline.gold_labels", "GoldLabelsConfig", "run",
        "gold granularity labels (level_min, level_max) from QASPER / SQuAD evidence, with their distribution",
    ),
    ("data", "mix"): (
        "overstory.data_pipeline.label_mix", "LabelMixConfig", "run",
        "one planner label file from several (gold and pseudo-labels of several datasets), with its hierarchy",
    ),
    ("data", "lattice-tree"): (
        "overstory.data_pipeline.lattice_tree", "LatticeTreeConfig", "run",
        "LATTICE's semantic tree: 5-level keyword summaries of every leaf, then top-down LLM clustering",
    ),
    ("data", "lattice-tree-stats"): (
        "overstory.data_pipeline.lattice_tree", "LatticeTreeStatsConfig", "run_stats",
        "a saved LATTICE tree's depth, branching, leaves per node and build cost",
    ),
    ("data", "lattice-traces"): (
        "overstory.data_pipeline.lattice_traces", "LatticeTracesConfig", "run",
        "LATTICE searches with a teacher scorer over training questions, every slate logged (resumable)",
    ),
    ("data", "fable-forest"): (
        "overstory.data_pipeline.fable_forest", "FableForestConfig", "run",
        "FABLE's forest: LLM semantic chunks, one tree per document (titles, summaries), node embeddings (resumable)",
    ),
    ("data", "orion-tags"): (
        "overstory.data_pipeline.orion_tags", "OrionTagsConfig", "run",
        "Orion-RAG's index: sliding-window chunks, LLM master and paragraph tags (resumable), path/text/BM25 indexes",
    ),
    ("data", "orion-tags-edit"): (
        "overstory.data_pipeline.orion_tags", "OrionTagEditConfig", "run_edit",
        "change one document's Orion-RAG master tags (add=[TAG] remove=[TAG]) and re-index that document alone",
    ),
    ("data", "verl-export"): (
        "overstory.training.verl.export", "VerlExportConfig", "run",
        "the planner's GRPO prompts and SFT traces as verl parquet (reward entry: training/verl/reward.py)",
    ),
    ("train", "distill-scorer"): (
        "overstory.training.distill_scorer", "DistillScorerConfig", "run",
        "LATTICE's traversal scorer distilled from its traces: a LoRA LLM (TRL SFT) or a cross-encoder student",
    ),
    ("train", "compressor"): (
        "overstory.training.compressor", "CompressorJobConfig", "run",
        "train the chunk compression encoder on summary embeddings (runs under accelerate launch too)",
    ),
    ("train", "text_compressor"): (
        "overstory.training.text_compressor", "TextCompressorJobConfig", "run",
        "fine-tune the sentence encoder to embed a group's child texts as its summary (compressor design b)",
    ),
    ("train", "planner_sft"): (
        "overstory.training.planner_sft", "PlannerSftConfig", "run",
        "supervised fine-tuning of the planner on teacher traces (TRL SFTTrainer; LoRA or full)",
    ),
    ("train", "planner_grpo"): (
        "overstory.training.planner_grpo", "PlannerGrpoConfig", "run",
        "GRPO with the DAPO loss for the planner (TRL GRPOTrainer) on format/length/alignment/cost/QA rewards",
    ),
    ("train", "stitch"): (
        "overstory.training.stitch", "StitchConfig", "run",
        "STITCH: GRPO on solvable questions, hinted rollouts, SFT on the imitation buffer (TRL trainers)",
    ),
    ("serve", ""): (
        "overstory.serve", "ServeConfig", "run",
        "start the embedded OpenAI-compatible server for the roles in a config (and a saved retriever: --retriever)",
    ),
    ("index", "build"): (
        "overstory.index_job", "IndexBuildConfig", "run",
        "a saved retriever folder: a corpus, its hierarchy and one strategy's index, for serve --retriever",
    ),
    ("eval", "rag"): (
        "overstory.evaluation.rag", "RagEvalConfig", "run",
        "retrieve-then-generate over a QA dataset: recall@k, exact match, token F1, latency",
    ),
    ("eval", "lattice"): (
        "overstory.evaluation.lattice", "LatticeEvalConfig", "run",
        "LATTICE search with each scorer beside BM25, dense, hybrid and LATTICE++: nDCG@10, Recall@10/100, cost",
    ),
    ("eval", "pipeline"): (
        "overstory.evaluation.pipeline", "PipelineEvalConfig", "run",
        "every retrieval strategy on the same questions and generator: answer quality, recall, cost per question",
    ),
    ("eval", "compressor"): (
        "overstory.evaluation.compressor", "EvalCompressorConfig", "run",
        "compressor vs mean_pool vs direct_encode vs summarize on held-out documents: cosine, recall@k, cost",
    ),
    ("eval", "planner"): (
        "overstory.evaluation.planner", "EvalPlannerConfig", "run",
        "planner checkpoints: accuracy vs labels and gold levels, format, length, speed, SmartChunk QA; --compare",
    ),
    ("bench", "serve"): (
        "overstory.bench.serve", "ServeBenchConfig", "run",
        "requests/s and latency percentiles per serving engine (in-process, embedded, vLLM), load phase",
    ),
    ("bench", "generate"): (
        "overstory.bench.generate", "GenerateBenchConfig", "run",
        "batched generation tokens/s of one chat model per setting (dtype, device, batch limits) and concurrency",
    ),
    ("bench", "retrieval"): (
        "overstory.retrieval_bench", "RetrievalBenchConfig", "run",
        "bounded load on a saved retriever's /v1/retrieve and /retrieve: failures, malformed statuses, latency, memory",
    ),
    ("bench", "capacity"): (
        "overstory.bench.capacity", "CapacityConfig", "run",
        "the capacity plan: calls, tokens and GPU-hours per pipeline step, projected to scale from measured metrics",
    ),
    ("bench", "train"): (
        "overstory.bench.train", "TrainBenchConfig", "run",
        "training samples/s and peak memory per recipe, one process against DDP and DeepSpeed launchers",
    ),
    ("quickstart", ""): (
        "overstory.quickstart", "QuickstartConfig", "run",
        "the main job on the embedded CPU stack; writes report.json and plots",
    ),
}

GROUP_HELP = {
    "data": "offline data generation: chunk hierarchies, summaries, planner pseudo-labels, gold labels and traces",
    "train": "training recipes",
    "index": "build a persisted retriever (a strategy's index over a corpus) for serve --retriever and the Python API",
    "serve": "serve models for the retrieval runtime",
    "eval": "evaluate checkpoints and retrieval strategies",
    "bench": "benchmarks that print ratios against a baseline measured in the same run",
    "quickstart": "run the main job end to end on the embedded CPU stack",
}


def job_config_class(group: str, name: str = "") -> type:
    """The config dataclass of a job; imports the job's module (slow: torch and friends), so only on demand."""
    module, cls, _, _ = JOBS[(group, name)]
    return getattr(importlib.import_module(module), cls)
