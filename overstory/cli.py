"""The `overstory` command: data, train, serve, eval, bench and quickstart.

Every job takes ``--config FILE`` plus dotted overrides (``train.lr=1e-5``). A job is a module
with a frozen config dataclass and a ``run(config)`` function; modules are imported only when
their job runs, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from overstory.config import ConfigError, load_config

# (group, name) -> (module, config class, run function). Group "serve" and "quickstart" have one job.
JOBS: dict[tuple[str, str], tuple[str, str, str, str]] = {
    ("data", "hierarchy"): (
        "data_pipeline.hierarchy_job", "HierarchyJobConfig", "run",
        "build multi-level chunk hierarchies for a corpus; print per-level counts and token statistics",
    ),
    ("data", "summaries"): (
        "data_pipeline.summaries", "SummariesConfig", "run",
        "LLM summaries of upper-level chunks plus child and summary embeddings (compressor training data)",
    ),
    ("data", "pseudo-labels"): (
        "data_pipeline.pseudo_labels", "PseudoLabelsConfig", "run",
        "planner labels: retrieve over all levels, answer with the backbone, expand until correct",
    ),
    ("data", "traces"): (
        "data_pipeline.traces", "TracesConfig", "run",
        "planner reasoning traces that justify each pseudo-label, from a pool of teachers; yield per teacher",
    ),
    ("data", "verl-export"): (
        "training.verl.export", "VerlExportConfig", "run",
        "the planner's GRPO prompts and SFT traces as verl parquet (reward entry: training/verl/reward.py)",
    ),
    ("train", "compressor"): (
        "training.compressor", "CompressorJobConfig", "run",
        "train the chunk compression encoder on summary embeddings (runs under accelerate launch too)",
    ),
    ("train", "text_compressor"): (
        "training.text_compressor", "TextCompressorJobConfig", "run",
        "fine-tune the sentence encoder to embed a group's child texts as its summary (compressor design b)",
    ),
    ("train", "planner_sft"): (
        "training.planner_sft", "PlannerSftConfig", "run",
        "supervised fine-tuning of the planner on teacher traces (TRL SFTTrainer; LoRA or full)",
    ),
    ("train", "planner_grpo"): (
        "training.planner_grpo", "PlannerGrpoConfig", "run",
        "GRPO with the DAPO loss for the planner (TRL GRPOTrainer) on format/length/alignment/cost/QA rewards",
    ),
    ("train", "stitch"): (
        "training.stitch", "StitchConfig", "run",
        "STITCH: GRPO on solvable questions, hinted rollouts, SFT on the imitation buffer (TRL trainers)",
    ),
    ("serve", ""): (
        "serving.launch", "ServeConfig", "run",
        "start the embedded OpenAI-compatible server for the roles in a config",
    ),
    ("eval", "rag"): (
        "evaluation.rag", "RagEvalConfig", "run",
        "retrieve-then-generate over a QA dataset: recall@k, exact match, token F1, latency",
    ),
    ("eval", "compressor"): (
        "evaluation.compressor", "EvalCompressorConfig", "run",
        "compressor vs mean_pool vs direct_encode vs summarize on held-out documents: cosine, recall@k, cost",
    ),
    ("eval", "planner"): (
        "evaluation.planner", "EvalPlannerConfig", "run",
        "planner checkpoints: accuracy vs labels and gold levels, format, length, speed, SmartChunk QA; --compare",
    ),
    ("bench", "serve"): (
        "serving.bench", "ServeBenchConfig", "run",
        "requests/s and latency percentiles per serving engine (in-process, embedded, vLLM), load phase",
    ),
    ("bench", "train"): (
        "training.bench", "TrainBenchConfig", "run",
        "training samples/s and peak memory per recipe, one process against DDP and DeepSpeed launchers",
    ),
    ("quickstart", ""): (
        "overstory.quickstart", "QuickstartConfig", "run",
        "the main job on the embedded CPU stack; writes report.json and plots",
    ),
}

GROUP_HELP = {
    "data": "offline data generation: chunk hierarchies, summaries, planner pseudo-labels and traces",
    "train": "training recipes",
    "serve": "serve models for the retrieval runtime",
    "eval": "evaluate checkpoints and retrieval strategies",
    "bench": "benchmarks that print ratios against a baseline measured in the same run",
    "quickstart": "run the main job end to end on the embedded CPU stack",
}


def job_config_class(group: str, name: str = "") -> type:
    module, cls, _, _ = JOBS[(group, name)]
    return getattr(importlib.import_module(module), cls)


# Flags that are shorthand for the override of the same name, for the jobs whose config has the key.
SHORTHAND_FLAGS = ("out", "checkpoint", "data", "compare", "engine")


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see configs/)")
    for flag in SHORTHAND_FLAGS:
        parser.add_argument(f"--{flag}", help=f"same as the override {flag}=VALUE")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overstory", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    groups = parser.add_subparsers(dest="group", metavar="{data,train,serve,eval,bench,quickstart}")
    for group, help_text in GROUP_HELP.items():
        gp = groups.add_parser(group, help=help_text, description=help_text)
        names = [name for (g, name) in JOBS if g == group]
        if names == [""]:
            _add_job_args(gp)
            gp.set_defaults(job=(group, ""))
            continue
        jobs = gp.add_subparsers(dest="job_name", metavar="{" + ",".join(names) + "}")
        for name in names:
            desc = JOBS[(group, name)][3]
            jp = jobs.add_parser(name, help=desc, description=desc)
            _add_job_args(jp)
            jp.set_defaults(job=(group, name))
    return parser


def run_job(group: str, name: str, config_path: str | None, overrides: list[str]) -> Any:
    module, cls_name, fn_name, _ = JOBS[(group, name)]
    mod = importlib.import_module(module)
    config = load_config(getattr(mod, cls_name), config_path, overrides)
    return getattr(mod, fn_name)(config)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before and after flags; argparse leaves the ones after a flag unparsed.
    args, rest = parser.parse_known_args(argv)
    stray = [item for item in rest if item.startswith("-") or "=" not in item]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if rest:
        args.overrides = [*getattr(args, "overrides", []), *rest]
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s: %(message)s"
    )
    for chatty in ("httpx", "bm25s"):  # an INFO line per request / index build drowns the progress bars
        logging.getLogger(chatty).setLevel(logging.WARNING)
    if args.group is None:
        parser.print_help()
        return 0
    job = getattr(args, "job", None)
    if job is None:  # a group without a job name: show the group's jobs
        parser.parse_args([args.group, "--help"])
        return 0
    overrides = list(args.overrides) + [f"{flag}={getattr(args, flag)}" for flag in SHORTHAND_FLAGS
                                        if getattr(args, flag, None) is not None]
    try:
        run_job(job[0], job[1], args.config, overrides)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
