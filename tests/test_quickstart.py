"""`overstory quickstart` end to end with the real built-in models (a slice of its default sizes), and the settings its
later stages give their jobs."""

from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.quickstart import (
    QuickstartConfig,
    compressor_eval_config,
    lattice_eval_config,
    planner_eval_config,
    rag_eval_config,
)
from overstory.serving.config import ServeConfig

STAGES = ("hierarchy", "serving", "retrieval", "rag_baseline", "compressor", "planner", "lattice", "strategies")


@pytest.fixture
def port_8000_taken():
    """Another server on 8000 (if 8000 is free here): the quickstart's private stack must not need it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 8000))
        sock.listen()
    except OSError:
        pass  # someone already serves there, which is the same test
    yield
    sock.close()


def test_later_stages_keep_every_serve_setting_but_the_port(tmp_path: Path) -> None:
    """``quickstart serve.engine=vllm`` must start the stages' own stacks on vLLM too, with the same key and vLLM
    settings: each stage's job gets the job's serve config with only the port freed."""
    serve = replace(ServeConfig.local(port=8000), engine="vllm", api_key="secret", vllm_args=["--max-model-len=4096"],
                    vllm_python="/opt/vllm/bin/python", vllm_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, log_dir="logs")
    config = QuickstartConfig(out=str(tmp_path), serve=serve)
    expected = replace(serve, port=0)
    for build in (rag_eval_config, compressor_eval_config, planner_eval_config, lattice_eval_config):
        assert build(config, tmp_path, "http://127.0.0.1:1234").serve == expected, build.__name__


# A slice of the job's defaults (configs/quickstart.yaml), each size the smallest that keeps its checks able to fail
# and reliably true: the first 3 HotpotQA questions (hybrid retrieval finds their gold paragraphs); 9 SQuAD questions,
# 3 per article (the backbone, whose cut replies are asked again with more room, answers both first questions of
# the held-out article when there are 2 per article: with 3, one is left to be planned unlabelled); 8 SFT epochs on
# that one trace (loss ~0.05: the plan format is learned; 4 were not enough); a 20-leaf tree (the paragraphs of 2
# questions), depth 2, so the search keeps its 2 iterations; 2 traced questions, one held out; 1 question per
# strategy corpus, the first 60 HotpotQA documents holding all of one question's paragraphs, HotpotQA only (SQuAD's
# half, searched within each article, took twice HotpotQA's time a question; document scope has its own tests in
# tests/retrieval/test_scope.py and tests/test_quickstart_retrieval.py). Summaries are shorter and read less of each
# section.
RAG_QUESTIONS = 3
LEAVES, M_MAX = 20, 10
TRACE_QUESTIONS = 2
STUDENT_STEPS = 4
STRATEGY_QUESTIONS = 1
SLICE = [f"rag_questions={RAG_QUESTIONS}",
         "compressor.max_summary_tokens=16", "compressor.max_input_chars=500",
         "planner.questions=9", "planner.sft_epochs=8", "planner.eval_questions=1",
         f"lattice.leaves={LEAVES}", f"lattice.m_max={M_MAX}", f"lattice.trace_questions={TRACE_QUESTIONS}",
         "lattice.heldout_fraction=0.5", f"lattice.student_steps={STUDENT_STEPS}",
         f"strategies.questions={STRATEGY_QUESTIONS}", "strategies.limit_docs=60", "strategies.corpora=[hotpotqa]"]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # every stage in one test: about 6.5 minutes on 2 cores shared at load ~3.3
def test_quickstart_end_to_end(tmp_path: Path, port_8000_taken) -> None:
    """``overstory quickstart`` on a slice of its defaults (``SLICE``): every stage runs on the real built-in models
    and reports its figures and seconds. The slice proves that the stages run and report correctly, not what the
    defaults measure: those figures come from ``make quickstart`` (docs/results.md), and
    tests/test_config.py::test_the_quickstart_config_spells_out_the_defaults keeps configs/quickstart.yaml equal to
    the code's defaults. The defaults cost 460-710 s of the suite; the slice keeps the stages, not the sizes."""
    out = tmp_path / "qs"
    (out).mkdir()
    # a stage written by another job must survive the quickstart's report update
    (out / "report.json").write_text(json.dumps({"stages": {"later_issue": {"x": 1}}}))
    # the default serve port (0: a free one, while 8000 is taken)
    code = main(["quickstart", "--out", str(out), "tracking.backend=jsonl", f"tracking.dir={tmp_path / 'tracking'}",
                 *SLICE])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    stages = report["stages"]
    assert stages["later_issue"] == {"x": 1}
    for name in STAGES:  # every stage timed, in the stage and in the report's table
        assert stages[name]["seconds"] > 0 and report["stage_seconds"][name] == stages[name]["seconds"]
    assert report["total_seconds"] >= sum(report["stage_seconds"][name] for name in STAGES) - 1
    serving = stages["serving"]
    assert serving["port"] != 8000 and serving["url"].endswith(f":{serving['port']}")

    rag = stages["rag_baseline"]  # `eval rag`: the harness with the naive strategy
    assert rag["dataset"] == "hotpotqa" and rag["n_questions"] == RAG_QUESTIONS and rag["answered"] == RAG_QUESTIONS
    for key in ("recall@5", "exact_match", "token_f1"):
        assert 0.0 <= rag[key] <= 1.0
    assert rag["recall@5"] > 0.5  # hybrid retrieval reaches most gold paragraphs (measured 0.86 on all 40)
    # answering, within the stage's wall time: each question's (the mean of the questions' times; they are answered
    # concurrently, so their sum may pass the wall time once the stage's indexes reuse the kept embeddings)
    assert 0 < rag["seconds_per_question"] < rag["seconds"]
    assert rag["usage_total"]["generator"]["calls"] == RAG_QUESTIONS and rag["costs_add_up"]["match"]
    assert rag["usage_total"]["generator"]["completion_tokens"] > 0

    for corpus in ("hotpotqa", "squad"):
        levels = stages["hierarchy"][corpus]
        assert set(levels) >= {"sentence", "paragraph", "subsection", "section", "document"}
        assert stages["retrieval"][corpus]["hybrid_recall@5"] > 0.5
    # a SQuAD question searched within its own article, HotpotQA's over the whole corpus
    assert (stages["retrieval"]["squad"]["scope"], stages["retrieval"]["hotpotqa"]["scope"]) == ("document", "corpus")
    compressor = stages["compressor"]
    assert compressor["summaries"]["ok"] == stages["hierarchy"]["squad"]["section"]["count"]  # every section
    assert compressor["training"]["epochs"] == 15
    assert set(compressor["step_seconds"]) == {"summaries", "training", "evaluation"}
    assert set(compressor["methods"]) == {"compressor", "mean_pool", "direct_encode", "summarize"}
    assert compressor["n_questions"] > 50 and Path(compressor["plot"]).exists()
    # top-1 among the held-out article's sections: a ranking, not every method finding everything at k=5
    assert all(0 < row["recall@1"] <= 1 for row in compressor["methods"].values())
    assert compressor["n_upper_chunks"] > 1
    planner = stages["planner"]
    assert planner["pseudo_labels"]["correct"] > 0 and planner["trace_yield"]["template"]["kept"] > 0
    assert planner["stitch"]["steps"] == 1 and set(planner["variants"]) == {"base", "sft", "stitch"}
    assert planner["variants"]["base"]["format_valid"] == 0.0  # measured: the base model never writes the plan
    assert planner["format_valid"]["sft"] > 0  # the SFT planner learned the plan format from the template traces
    # the held-out article's unanswered questions are planned too (most of them: the backbone answers few)
    assert planner["n_unlabelled"] > 0 and planner["format_valid"]["base"] == 0.0
    assert set(planner["step_seconds"]) == {"pseudo_labels", "traces", "sft", "stitch", "eval"}
    assert all(Path(p).exists() for p in planner["plots"])
    assert (out / "level_stats.png").stat().st_size > 10_000
    assert (out / "hierarchies" / "squad.jsonl").exists()
    predictions = Path(rag["predictions"]).read_text().splitlines()
    assert len(predictions) == RAG_QUESTIONS and all(json.loads(p)["raw"] for p in predictions)

    lattice = stages["lattice"]
    tree = lattice["tree"]
    assert tree["method"] == "bottom-up" and tree["stats"]["leaves"] == LEAVES
    assert tree["stats"]["branching"]["max"] <= M_MAX
    assert tree["summaries"]["llm_calls"] > 0  # the generator named the nodes
    assert lattice["traces"]["questions"] == TRACE_QUESTIONS and lattice["traces"]["slates"] > 0
    assert lattice["student"]["steps"] == STUDENT_STEPS
    systems = lattice["systems"]
    assert set(systems) == {"oracle", "teacher", "ce_student", "bm25", "dense", "hybrid", "lattice++"}
    assert lattice["n_questions"] >= 1  # the student's held-out questions, and only those
    for row in systems.values():
        assert 0.0 <= row["ndcg@10"] <= 1.0 and 0.0 <= row["recall@100"] <= 1.0
    assert systems["teacher"]["llm_calls"] > 0 and systems["teacher"]["input_tokens"] > 0  # from the server's usage
    assert systems["oracle"]["llm_calls"] == 0 and systems["bm25"]["llm_calls"] == 0
    assert "agreement" in systems["ce_student"] and "agreement" not in systems["teacher"]
    assert set(lattice["step_seconds"]) == {"tree", "traces", "distill", "eval"}
    assert Path(lattice["plot"]).exists() and Path(lattice["table"]).read_text().count("|") > 20

    strategies = stages["strategies"]
    assert strategies["strategies"] == ["naive", "smartchunk", "arag"] and list(strategies["corpora"]) == ["hotpotqa"]
    for name, row in strategies["corpora"].items():
        assert row["n_questions"] == STRATEGY_QUESTIONS and Path(row["table"]).exists() and Path(row["plot"]).exists()
        for strategy, figures in row["strategies"].items():
            assert figures["costs_add_up"] is True, (name, strategy)  # the job's stack counted the same tokens
            assert 0.0 <= figures["contains_match"] <= 1.0 and figures["generator_tokens"] > 0
        assert row["strategies"]["smartchunk"]["llm_calls"] == 2  # planner, then generator
