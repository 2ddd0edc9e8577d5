"""overstory: train and serve the learned parts of hierarchical retrieval.

Where the code is: the parts live in top-level folders of the repository, not under ``overstory/``, and are
mapped into this package by ``[tool.setuptools.package-dir]`` in ``pyproject.toml``:

    overstory.training       training/        one recipe per method (compressor, planner SFT / GRPO / STITCH, ...)
    overstory.models         models/          model registry, compressor, planner and scorer prompts and parsers
    overstory.data_pipeline  data_pipeline/   corpora, hierarchies, summaries, labels, traces, index jobs
    overstory.serving        serving/         engine, OpenAI-compatible server, vLLM stacks, client
    overstory.retrieval      retrieval/       the runtime: indexes and retrieval strategies
    overstory.evaluation     evaluation/      the harness over every strategy, jobs over checkpoints, tables
    overstory.bench          bench/           benchmarks: serving, generation, load, training throughput

So ``overstory.training`` is the folder ``training/``, not ``overstory/training/``. This folder holds only
``core`` (configs, tracking, records: the ground every part uses) and the top that uses everything: ``cli``,
``jobs`` (the job table) and ``quickstart``. Layers and folders: docs/architecture.md.
"""
