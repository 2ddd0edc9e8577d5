"""Shared fixtures: caches point into the tree so tests never reach a hub (they are offline); the planner's
labels, traces and a short SFT adapter on real SQuAD questions; a LATTICE tree over real HotpotQA paragraphs, its
oracle traversal traces and the scorer students distilled from them; each made once per session (the summaries and
the SFT planner once per state of the code), and the tests sharing one kept on one xdist worker."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _pytest.nodeid import coerce_node_id

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

# Tests that `make test` runs after the two-worker phase, one at a time: each holds several GiB beside its worker's own
# models (the teacher's conversion, 9 GB at its peak; DeepSpeed's two launched processes), which next to the other
# worker and the cpu-vllm stack exhausted the 24 GiB CI machine; and STITCH's two launched ranks, which beside the other
# worker (three busy processes on two cores, the ranks meeting at every collective) took 2.2-2.4 times as long: 314 s
# and 195 s for its ZeRO-2 and ZeRO-3 tests in the two-worker phase, 130 s and 89 s alone (plus 82 s to make the SFT
# planner they start from).
ALONE = ("tests/models/test_teacher.py", "tests/test_teacher_jobs.py", "tests/training/test_distributed.py",
         "tests/training/test_stitch_distributed.py")


# Session fixtures that take about a minute each to make (a real SmolLM2 run, a chain of real jobs), by the xdist group
# of the tests that use them: under `--dist loadgroup` every worker would make its own copy of a session fixture its
# tests use, so the tests sharing one are kept on one worker, which makes it once. The SFT planner's tests join the
# cpu-vllm stack's group (tests/serving/conftest.py): that stack serves the SFT adapter, so its worker makes it anyway.
SHARED_FIXTURE_GROUPS = {"llm_student": "lattice_students", "ce_student": "lattice_students",
                         "lattice_oracle_traces": "lattice_students", "sft_planner": "cpu_vllm_stack",
                         "summaries": "summaries"}


def shared_fixture_group(item: pytest.Item) -> str | None:
    """The xdist group of the costly session fixture ``item`` uses (directly or through another fixture), if any."""
    used = getattr(item, "fixturenames", ())
    return next((group for name, group in SHARED_FIXTURE_GROUPS.items() if name in used), None)


def module_fixture_group(item: pytest.Item) -> str | None:
    """The group of ``item``'s module (its path) when the test uses a module-scoped fixture: a worker builds such a
    fixture for every module it runs a test of, so a module whose tests ``--dist loadgroup`` spread over both workers
    built it twice (the HotpotQA LATTICE tree of test_lattice_search.py, 30 s; the indexes of test_index.py)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None or not any(defs and defs[-1].scope == "module" for defs in info.name2fixturedefs.values()):
        return None
    return item.nodeid.split("::")[0].removesuffix(".py")


def name_groups_in_ids(items: list[pytest.Item]) -> None:
    """Append ``@group`` to the id of each test with an ``xdist_group`` mark, as pytest-xdist's worker hook means to.

    ``--dist loadgroup`` sends a group's tests to one worker by that suffix, which pytest-xdist (3.8, the newest)
    writes to ``item._nodeid``; pytest 9 reads the id from ``item._id``, so the suffix never reached the ids and no
    group was kept together (not this file's, nor the cpu-vllm stack's of tests/serving/conftest.py)."""
    for item in items:
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        suffix = f"@{'_'.join(groups)}"
        if groups and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            item._id = coerce_node_id(item.nodeid + suffix)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    """Mark the ``alone`` tests and the groups of ``SHARED_FIXTURE_GROUPS``; after every other plugin and conftest has
    marked its own, keep each module with a module-scoped fixture on one worker (``module_fixture_group``: only the
    tests left without a group, so none leaves the cpu-vllm stack's) and name the groups in the test ids on an xdist
    worker (``name_groups_in_ids``); then put the long single tests first (``is_long_single``)."""
    for item in items:
        if item.nodeid.startswith(ALONE):
            item.add_marker(pytest.mark.alone)
        elif item.get_closest_marker("xdist_group") is None and (group := shared_fixture_group(item)):
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    for item in items:
        if item.get_closest_marker("xdist_group") is None and (group := module_fixture_group(item)):
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False):
        name_groups_in_ids(items)
    items.sort(key=lambda item: not is_long_single(item))
    return result


def is_long_single(item: pytest.Item) -> bool:
    """A ``slow`` test outside every xdist group: these run first among the single tests. ``--dist loadgroup`` hands
    out the groups (most tests first), then the single tests in collection order, so the quickstart's end-to-end test
    (5 minutes, in tests/test_quickstart.py) started last of all and one worker ran it alone while the other had
    finished (130 s of the two-worker phase); started early, the short tests left fill both workers to the end."""
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("xdist_group") is None


@pytest.fixture
def engines():
    """``engines(serve_config)`` loads an ``EmbeddedEngine`` that is closed after the test: an engine left open keeps
    its models (and its batcher thread) for the rest of the session."""
    from overstory.serving.engine import EmbeddedEngine

    made: list[EmbeddedEngine] = []

    def make(config):
        made.append(EmbeddedEngine(config))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's retries without their waits (``$OVERSTORY_HTTP_BACKOFF_S`` 0.01 s, not 0.5 s doubling), for the
    tests whose jobs meet a server that fails on purpose: every failed request's retries slept 3.5 s on average (one
    timed-out-slate test idled 31 of its 32 s). The retries themselves still happen, and are counted."""
    from overstory.serving.client import BACKOFF_ENV

    monkeypatch.setenv(BACKOFF_ENV, "0.01")


@pytest.fixture(scope="session")
def squad_chunks() -> list:
    """The hierarchy of the three shipped SQuAD articles (default settings), built once."""
    from overstory.data_pipeline.corpora import load_corpus
    from overstory.data_pipeline.hierarchy import HierarchyConfig, build_hierarchies

    return build_hierarchies(load_corpus("squad", SQUAD)[0], HierarchyConfig())


def store_labels(path: Path, labels: list, chunks: list) -> Path:
    """Write pseudo-labels and, beside them, the hierarchy they refer to, as the pseudo-labels job does."""
    from overstory.core.records import write_jsonl
    from overstory.data_pipeline.hierarchy import save_hierarchies, stored_hierarchy_path

    write_jsonl(path, labels)
    save_hierarchies(stored_hierarchy_path(path), chunks)
    return path


@pytest.fixture(scope="session")
def planner_labels(tmp_path_factory, squad_chunks) -> Path:
    """Pseudo-labels for 24 real SQuAD questions over the three articles. The ranges are chosen here,
    cycling through four, so the planner tests see every level (the labelling job has its own test)."""
    from overstory.core.records import PseudoLabel
    from overstory.data_pipeline.corpora import load_corpus
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
def sft_planner(request: pytest.FixtureRequest, tmp_path_factory) -> Path:
    """A short real planner_sft run on the template traces with a high learning rate: a policy that writes the
    planner's format, so GRPO (in planner_grpo and STITCH) sees rewards that differ within a group. Its
    ``metrics.json`` keeps the loss per step. Kept by the code's state (``kept_by_code_state``): the alone phase's
    STITCH tests start from the two-worker phase's adapter instead of training it again (57 s)."""
    from overstory.cli import main

    def train(folder: Path) -> Path:
        traces = request.getfixturevalue("planner_traces")
        code = main(["train", "planner_sft", "--config", str(ROOT / "configs/train/planner_sft.yaml"),
                     f"traces={traces}", f"out={folder / 'sft'}", "train.max_steps=6", "train.batch_size=2",
                     "train.lr=3e-3", "train.warmup_ratio=0", "train.val_fraction=0", "train.max_length=384",
                     "train.logging_steps=1", "tracking.backend=none"])
        assert code == 0
        return folder / "sft"

    return kept_by_code_state("test-sft-planner", "sft", train, tmp_path_factory)


def one_solvable_one_not(labels: Path, adapter: Path, folder: Path, metadata_tokens: int, limit: int) -> Path:
    """Two of the labels, rewritten so that the policy solves one and not the other: the first question the adapter
    plans greedily within ``limit`` tokens, and to the same range whatever else is in its batch, is labelled with
    that range (near-greedy rollouts hit it), another with a range that is neither its greedy plan nor its trace's
    (solved, if at all, only by chance). Stored with their hierarchy, as the pseudo-labels job does. (Labelling every
    other question of a random draw of three once gave CI a draw that solved none.)

    The plans are generated a batch of 8 at a time, in order, and only until both picked questions have one: the
    same batches as one call over every question would make, so the same two questions are picked, without planning
    the rest. A batch's greedy replies depend on what else is in it (its padding), and STITCH rolls a question out
    beside the other one (one process) or alone (a rank of two): a candidate is kept only when its plan is the same
    range in both of those batches too (one CI machine's adapter planned the first candidate another way there, and
    the STITCH step solved neither question)."""
    from dataclasses import replace

    from overstory.core.records import PseudoLabel, read_jsonl, write_jsonl
    from overstory.data_pipeline.hierarchy import stored_hierarchy_path
    from overstory.data_pipeline.planner_examples import PlannerDataConfig, planner_rows
    from overstory.evaluation.planner import generate_plans
    from overstory.models.planner import parse_plan
    from overstory.models.registry import load_lm_checkpoint

    rows, _, _ = planner_rows(PlannerDataConfig(labels=str(labels), metadata_tokens=metadata_tokens, val_fraction=0),
                              "builtin:smollm2-135m-instruct")
    model, tokenizer, _ = load_lm_checkpoint(str(adapter))
    every = list(read_jsonl(labels, PseudoLabel))
    prompts = {r["example_id"]: r["prompt"] for r in rows}

    def levels(ids: list[str]) -> list[tuple]:
        replies, lengths, _ = generate_plans(model, tokenizer, [prompts[i] for i in ids], limit, len(ids))
        return [parse_plan(text).levels if n < limit else None for text, n in zip(replies, lengths)]

    greedy: dict[str, tuple] = {}
    solvable, hard, refused = None, None, set()
    for start in range(0, len(rows), 8):
        batch = rows[start: start + 8]
        replies, lengths, _ = generate_plans(model, tokenizer, [r["prompt"] for r in batch], limit, 8)
        greedy |= {r["example_id"]: (parse_plan(text), n) for r, text, n in zip(batch, replies, lengths)}
        for i, (plan, n) in greedy.items():
            if solvable or i in refused or not plan.valid or n >= limit:
                continue
            other = next(label for label in every if label.id != i)
            if levels([i]) == [plan.levels] and levels([i, other.id])[0] == plan.levels:
                solvable, hard = i, other
            else:
                refused.add(i)
        if hard and hard.id in greedy:
            break
    assert solvable, (f"the adapter planned none of {len(rows)} questions within {limit} tokens to one range alone "
                      f"and in a batch ({len(refused)} planned otherwise there)")
    easy = next(label for label in every if label.id == solvable)
    taken = {greedy[hard.id][0].levels, (hard.level_min, hard.level_max)}
    far = next(r for r in [("section", "document"), ("paragraph", "document"), ("sentence", "sentence")]
               if r not in taken)
    picked = [replace(easy, level_min=greedy[solvable][0].levels[0], level_max=greedy[solvable][0].levels[1]),
              replace(hard, level_min=far[0], level_max=far[1])]
    folder.mkdir()
    write_jsonl(folder / "labels.jsonl", picked)
    shutil.copy(stored_hierarchy_path(labels), stored_hierarchy_path(folder / "labels.jsonl"))
    return folder / "labels.jsonl"


@pytest.fixture(scope="session")
def stitch_labels(planner_labels: Path, sft_planner: Path, tmp_path_factory) -> Path:
    """Two of ``planner_labels`` that ``sft_planner`` solves one of within 72 tokens (prompts of 96 metadata tokens):
    the STITCH steps of tests/training/test_stitch.py and test_stitch_distributed.py run on them (a GRPO update on the
    solved one, an SFT injection for the other); the jobs only read them, so they are made once."""
    return one_solvable_one_not(planner_labels, sft_planner / "final", tmp_path_factory.mktemp("stitch") / "labels",
                                96, 72)


HOTPOTQA_150 = [f"corpus.path={ROOT / 'data/hotpotqa'}", "corpus.limit_docs=150"]  # 11 questions with gold leaves


@pytest.fixture(scope="session")
def lattice_tree(tmp_path_factory) -> Path:
    """A LATTICE tree over the first 150 HotpotQA paragraphs (leaf ids as the lattice-tree job gives them), clustered
    by k-means on MiniLM (token_budget=0: no LLM; the LLM construction has its own tests), at most 6 children."""
    from overstory.core.config import load_config
    from overstory.data_pipeline.lattice_tree import LatticeTreeConfig, corpus_leaves
    from overstory.models.registry import MINILM, load_sentence_encoder
    from overstory.retrieval.lattice.keywords import fallback_keywords
    from overstory.retrieval.lattice.top_down import TopDownBuilder

    config = load_config(LatticeTreeConfig, ROOT / "configs/data/lattice_tree.yaml", [*HOTPOTQA_150, "out=unused"])
    leaves = corpus_leaves(config)
    encoder = load_sentence_encoder(MINILM)
    builder = TopDownBuilder(client=None, embed=lambda texts: encoder.encode(texts), m_max=6, token_budget=0)
    tree = builder.build(leaves, {leaf.id: fallback_keywords(leaf.text) for leaf in leaves})
    return tree.save(tmp_path_factory.mktemp("lattice_tree") / "tree.json")


@pytest.fixture(scope="session")
def lattice_oracle_traces(lattice_tree: Path) -> Path:
    """Traversal traces of all 11 questions with the oracle as the teacher (scores 100 for a candidate that leads
    to gold, else 0; no reasoning): the distillation data of the student tests. A real traces run."""
    from overstory.cli import main

    out = lattice_tree.parent / "traces.jsonl"
    assert main(["data", "lattice-traces", "--config", str(ROOT / "configs/data/lattice_traces.yaml"),
                 f"tree={lattice_tree}", f"out={out}", *HOTPOTQA_150, "scorer=oracle", "search.iterations=4",
                 "tracking.backend=none"]) == 0
    return out


def distill(traces: Path, out: Path, config: str, *overrides: str) -> Path:
    """``overstory train distill-scorer`` as a user runs it; returns ``out``."""
    from overstory.cli import main

    assert main(["train", "distill-scorer", "--config", str(ROOT / "configs/train" / config), f"traces={traces}",
                 f"out={out}", "train.val_fraction=0.2", "tracking.backend=none", *overrides]) == 0
    return out


@pytest.fixture(scope="session")
def ce_student(lattice_oracle_traces: Path, tmp_path_factory) -> Path:
    """A cross-encoder student (pointwise) distilled from the oracle traces: 40 steps from the built-in MiniLM."""
    return distill(lattice_oracle_traces, tmp_path_factory.mktemp("ce_student") / "ce",
                   "distill_scorer_cross_encoder.yaml", "train.max_steps=40", "train.lr=3e-4",
                   "train.max_length=128", "max_candidate_chars=300", "train.logging_steps=5")


@pytest.fixture(scope="session")
def llm_student(lattice_oracle_traces: Path, tmp_path_factory) -> Path:
    """A LoRA LLM student on SmolLM2 distilled from the oracle traces: 2 steps (it checks the recipe and its
    serving, not what two steps learn)."""
    return distill(lattice_oracle_traces, tmp_path_factory.mktemp("llm_student") / "llm", "distill_scorer_llm.yaml",
                   "train.max_steps=2", "train.batch_size=2", "max_candidate_chars=120", "train.max_length=1024",
                   "train.logging_steps=1")


def code_state() -> str | None:
    """A key that changes whenever the checkout's code does: HEAD and the diff of the tracked files against it,
    hashed; None outside a git checkout (nothing is then kept between sessions)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return hashlib.sha256(head + diff).hexdigest()[:16]


def keep_folder(folder: Path, kept: Path, max_age_s: float = 6 * 3600) -> None:
    """Copy ``folder`` to ``kept`` whole or not at all (a copy beside it, then one rename); where another session
    kept it first, theirs stays. Folders kept beside it for earlier code states go once older than ``max_age_s``
    (longer than any session that could still be reading one)."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    for old in kept.parent.iterdir():
        if old != kept and time.time() - old.stat().st_mtime > max_age_s:
            shutil.rmtree(old, ignore_errors=True)
    staging = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
    shutil.copytree(folder, staging)
    try:
        staging.rename(kept)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def kept_by_code_state(name: str, made: str, make: Callable[[Path], Path], tmp_path_factory) -> Path:
    """What ``make(folder)`` makes in a new temporary folder (it returns ``folder / made``), kept under the cache in
    ``name/<code_state()>`` and read from there while the code is unchanged: the alone phase of `make test` is a
    second pytest session, which would otherwise make again what the two-worker phase made."""
    key = code_state()
    kept = Path(os.environ["OVERSTORY_CACHE"]) / name / key if key else None
    if kept and (kept / made).exists():
        return kept / made
    folder = tmp_path_factory.mktemp(name)
    out = make(folder)
    if kept:
        keep_folder(folder, kept)
    return out


@pytest.fixture(scope="session")
def summaries(tmp_path_factory) -> Path:
    """SmolLM2 summaries of 30 HotpotQA paragraphs (the compressors' training data and the training bench's).

    Generated one request at a time (``concurrency=1``): greedy decoding of a batch depends on what else is in the
    batch (padding changes the floating-point sums), so concurrent requests gave summaries, and training targets,
    that differed from run to run; alone, each prompt's greedy summary is the same every run. That is why they are
    also kept by the code's state (``kept_by_code_state``): the alone phase's distributed tests train on the
    two-worker phase's summaries instead of generating them again, and any change to the code generates them afresh."""
    from overstory.cli import main

    def generate(folder: Path) -> Path:
        out = folder / "hotpotqa.jsonl"
        code = main(["data", "summaries", "--config", str(ROOT / "configs/data/summaries.yaml"), f"out={out}",
                     "corpus.kind=hotpotqa", f"corpus.path={ROOT / 'data/hotpotqa'}", "levels=[paragraph]",
                     "limit=30", "max_summary_tokens=24", "concurrency=1", "tracking.backend=none"])
        assert code == 0
        return out

    return kept_by_code_state("test-summaries", "hotpotqa.jsonl", generate, tmp_path_factory)
