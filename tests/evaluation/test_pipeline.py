"""`overstory eval pipeline`: every strategy on the same real HotpotQA questions through the HTTP stack of the
built-in models, every metric present, the per-role token sums equal to what the server counted, the QASPER
prediction format, and bad configs naming their key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.cli import main
from overstory.core.config import ConfigError
from overstory.core.records import Document, QAExample
from overstory.data_pipeline.corpora import CorpusConfig, load_corpus
from overstory.evaluation.pipeline import (
    JudgeConfig,
    answer_question,
    judge_sanity,
    summarise,
)
from overstory.evaluation.pipeline_qasper import qasper_predictions
from overstory.evaluation.pipeline_tables import pipeline_table
from overstory.models.registry import MINILM, SMOLLM2
from overstory.retrieval.strategy import RequestRefused
from overstory.serving.client import Client, ClientError
from tests.conftest import HOTPOTQA_150, ROOT

CONFIG = str(ROOT / "configs/eval/pipeline.yaml")
QUALITY = ("exact_match", "token_f1", "contains_match", "rouge_l", "recall@5")
# the generator reads the first 300 characters of each of its 3 passages, not 1,500 (measured: a third fewer generator
# prompt tokens on the HotpotQA slice, more on QASPER's long paragraphs): the tests below check what each strategy
# retrieved and counted, which this does not change
SHORT_PASSAGES = "answer.max_chunk_chars=300"


def _run(out: Path, *overrides: str) -> dict:
    assert main(["eval", "pipeline", "--config", CONFIG, f"out={out}", "tracking.backend=none", *overrides]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_every_strategy_on_the_same_questions_and_costs_add_up(lattice_tree: Path, ce_student: Path,
                                                                tmp_path: Path) -> None:
    """naive, SmartChunk (the served planner) and LATTICE (the distilled cross-encoder served as the scorer)."""
    report = _run(tmp_path, "--strategies", "naive,smartchunk,lattice", "data=", *HOTPOTQA_150,
                  "limit_questions=2", f"lattice.tree={lattice_tree}", "lattice.scorer=cross_encoder",
                  "lattice.search.iterations=4", "serve.roles.scorer.kind=cross-encoder",
                  f"serve.roles.scorer.model={ce_student / 'final'}", "judge.enabled=true", "judge.role=generator",
                  SHORT_PASSAGES)
    assert report["n_questions"] == 2 and list(report["strategies"]) == ["naive", "smartchunk", "lattice"]
    assert report["checkpoints"]["scorer"]["model"] == str(ce_student / "final")
    assert report["judge_sanity"]["asked"] == 2  # the judge was first shown each reference as the answer
    ids = None
    for name, row in report["strategies"].items():
        assert row["n_questions"] == 2
        for key in (*QUALITY, "judge"):
            low, high = row[f"{key}_ci95"]
            assert 0.0 <= low <= row[key] <= high <= 1.0, (name, key)
        assert row["costs_add_up"]["match"], (name, row["usage_total"], row["costs_add_up"])
        assert row["usage_total"]["generator"]["calls"] == 2  # one answer per question
        assert row["generator_tokens"] > 0 and row["seconds"] > 0 and row["judge_usage"]["generator"]["requests"] == 2
        records = [json.loads(line) for line in (tmp_path / "predictions" / f"{name}.jsonl").read_text().splitlines()]
        assert ids is None or [r["id"] for r in records] == ids  # the same questions, in the same order
        ids = [r["id"] for r in records]
        # the stack is up: every question is answered by the generator, none failed
        assert all(r["failure"] == "" and r["raw"] for r in records), [r["failure_detail"] for r in records]
        assert row["answered"] == 2 and row["failures"] == {}
        # the row's figures are the sums and means over the saved records
        for role, totals in row["usage_total"].items():
            assert totals["prompt_tokens"] == sum(r["usage"][role]["prompt_tokens"] for r in records if role in
                                                  r["usage"]), (name, role)
        assert row["contains_match"] == pytest.approx((records[0]["contains_match"] + records[1]["contains_match"]) / 2)
    smartchunk, lattice = report["strategies"]["smartchunk"], report["strategies"]["lattice"]
    assert smartchunk["usage_total"]["planner"]["calls"] == 2 and smartchunk["llm_calls"] == 2
    table = (tmp_path / "table.md").read_text()
    # a plan the runtime could not read leaves its parser's error in the details: each is a repair of the row
    planned = [json.loads(line)["details"] for line in (tmp_path / "predictions" / "smartchunk.jsonl").open()]
    unparsed = sum("plan_error" in details for details in planned)
    assert smartchunk["repairs"] == ({"plan_unparsed": unparsed} if unparsed else {})
    row_line = table.split("| smartchunk |")[1].splitlines()[0]
    assert f"| {f'plan_unparsed {unparsed}' if unparsed else 0} | - |" in row_line  # repairs, then no slates
    assert lattice["usage_total"]["scorer"]["calls"] >= 2  # one batched /score call per slate
    lattice_records = [json.loads(line) for line in (tmp_path / "predictions" / "lattice.jsonl").open()]
    assert all(r["evidence"] for r in lattice_records)  # the search reached leaves
    slates = sum(r["details"]["slates"] for r in lattice_records)
    # a cross-encoder scores every candidate: no slate fails, and the table counts them
    assert slates >= 2 and lattice["slates"] == {"slates": slates, "failed": 0}
    assert f" | 0/{slates} | " in table.split("| lattice |")[1].splitlines()[0]
    assert (tmp_path / "quality_vs_cost.png").stat().st_size > 0 and (tmp_path / "quality_vs_seconds.png").exists()


def _hotpotqa_slice(folder: Path, n_questions: int, distractors: int) -> Path:
    """The shipped HotpotQA sample cut to its first questions, their gold paragraphs and ``distractors`` others: a
    corpus small enough for the strategies that build LLM indexes (FABLE's forest, Orion-RAG's tags) inside a test.
    Each question's context is cut to its gold paragraphs too (the loader adds every context paragraph to the
    corpus, and a question carries 10: one question made an 11-document corpus, whose indexes cost 3.7 times as
    many LLM calls as these 3 documents' while the test checks that each strategy runs, not how it ranks)."""
    corpus = json.loads((ROOT / "data/hotpotqa/corpus.json").read_text())
    questions = json.loads((ROOT / "data/hotpotqa/questions.json").read_text())[:n_questions]
    titles = {title for q in questions for title, _ in q["supporting_facts"]}
    titles |= set([t for t in corpus if t not in titles][:distractors])
    questions = [{**q, "context": [item for item in q["context"] if item[0] in titles]} for q in questions]
    folder.mkdir()
    (folder / "corpus.json").write_text(json.dumps({t: corpus[t] for t in corpus if t in titles}))
    (folder / "questions.json").write_text(json.dumps(questions))
    return folder


def test_the_strategies_that_build_llm_indexes_run_in_the_harness(tmp_path: Path) -> None:
    """A-RAG's agent, FABLE (its forest built here) and Orion-RAG (its tags written here) on a real question."""
    corpus = _hotpotqa_slice(tmp_path / "corpus", n_questions=1, distractors=1)
    report = _run(tmp_path / "out", "--strategies", "arag,fable,orion", "data=", f"corpus.path={corpus}",
                  "arag.max_turns=2", "orion_chunking.chunk_chars=2000", SHORT_PASSAGES)
    assert report["n_questions"] == 1
    for name, row in report["strategies"].items():
        (record,) = [json.loads(line) for line in (tmp_path / "out" / "predictions" / f"{name}.jsonl").open()]
        # the stack is up, so no request failed; SmolLM2-135M's agent may end its turns without an answer (a
        # failure of its own kind, with nothing predicted), the others always give the generator's reply
        allowed = ("", "no_answer") if name == "arag" else ("",)
        assert record["failure"] in allowed, (name, record["failure"], record["failure_detail"])
        assert bool(record["prediction"]) == (record["failure"] == "") and record["raw"], (name, record)
        assert row["costs_add_up"]["match"], (name, row["costs_add_up"])
        assert row["llm_calls"] >= 1 and 0.0 <= row["recall@5"] <= 1.0
    assert report["strategies"]["fable"]["index"]["usage"]["generator"]["requests"] > 0  # the forest was built
    assert (tmp_path / "out" / "orion_tags" / "chunks.jsonl").exists()
    assert report["strategies"]["orion"]["index"]["usage"]["generator"]["requests"] > 0  # the tags were written


def test_qasper_prediction_format_and_a_rerun_answers_only_new_questions(tmp_path: Path, capsys) -> None:
    """Over the six shipped QASPER papers, each question searched in its own paper (the dataset's scope): the first
    run answers one question; the second, asked for two, keeps it and answers one more (a killed run resumes the
    same way); a third with another answer setting, or over the open corpus, is refused, naming the key."""
    qasper = ("--strategies", "naive", "--data", "qasper", SHORT_PASSAGES)
    _run(tmp_path, *qasper, "limit_questions=1")
    first = (tmp_path / "predictions" / "naive.jsonl").read_text()
    report = _run(tmp_path, *qasper, "limit_questions=2")
    records = [json.loads(line) for line in (tmp_path / "predictions" / "naive.jsonl").read_text().splitlines()]
    assert len(records) == 2 and json.loads(first) == records[0]  # the first answer was kept, not made again
    runs = [json.loads(line) for line in (tmp_path / "predictions" / "naive.runs.jsonl").read_text().splitlines()]
    assert [len(run["question_ids"]) for run in runs] == [1, 1]
    row = report["strategies"]["naive"]
    assert report["scope"] == "document" and report["n_documents"] == 6
    assert (tmp_path / "table.md").read_text().startswith(
        "qasper, document scope: each question searched within its own document (of 6)\n")
    assert row["n_questions"] == 2 and row["usage_total"]["generator"]["calls"] == 2
    assert row["costs_add_up"] == {"match": True, "questions_checked": 2, "questions": 2, "runs": 2}
    lines = [json.loads(line) for line in (tmp_path / "qasper" / "naive.jsonl").read_text().splitlines()]
    paper = load_corpus(CorpusConfig("qasper", "data/qasper/dev.json", limit_docs=1))[0][0]
    paragraphs = {paper.text[a:b] for a, b in paper.metadata["paragraph_spans"]}
    assert [line["question_id"] for line in lines] == [r["id"] for r in records]
    # both questions are about the first paper, and every chunk they read is that paper's
    assert all(r["scope"] == [paper.id] and r["evidence"] for r in records)
    assert all(doc_id == paper.id for r in records for doc_id, _, _ in r["evidence_spans"])
    for line in lines:
        assert set(line) == {"question_id", "predicted_answer", "predicted_evidence"}
        assert isinstance(line["predicted_answer"], str) and line["predicted_evidence"]
        assert all(text in paragraphs for text in line["predicted_evidence"])  # verbatim, as the evaluator matches
    for changed, key in (("answer.max_tokens=8", "answer.max_tokens"), ("scope=corpus", "scope")):
        assert main(["eval", "pipeline", "--config", CONFIG, f"out={tmp_path}", "tracking.backend=none", *qasper,
                     "limit_questions=2", changed]) == 2
        assert f"{key} differ" in capsys.readouterr().err
    # each answer names the models that served its calls, and the table says so; answers kept from another model
    # (here: a record edited to name one) are not added to
    assert all(r["served_by"] == {"generator": SMOLLM2, "embedder": MINILM} for r in records), records[0]["served_by"]
    assert row["served_by"] == {"embedder": [MINILM], "generator": [SMOLLM2]} and row["served_unrecorded"] == 0
    assert f"served by: naive: embedder {MINILM}, generator {SMOLLM2}" in (tmp_path / "table.md").read_text()
    path = tmp_path / "predictions" / "naive.jsonl"
    path.write_text(path.read_text().replace(f'"generator": "{SMOLLM2}"', '"generator": "another-model"', 1))
    assert main(["eval", "pipeline", "--config", CONFIG, f"out={tmp_path}", "tracking.backend=none", *qasper,
                 "limit_questions=3"]) == 2
    assert f"the server serves role generator with {SMOLLM2}, but the answers kept in {path} were served by " \
           "another-model" in capsys.readouterr().err


def test_open_corpus_qasper_searches_every_paper_and_says_so(tmp_path: Path) -> None:
    """scope=corpus: the first paper's two questions searched over all six papers read other papers' paragraphs too
    (the generic "Which dataset do they evaluate on?" does), and the table and metrics.json name the variant."""
    report = _run(tmp_path, "--strategies", "naive", "--data", "qasper", "scope=corpus", "limit_questions=2",
                  SHORT_PASSAGES)
    assert report["scope"] == "corpus" and report["config"]["scope"] == "corpus"
    assert (tmp_path / "table.md").read_text().startswith(
        "qasper, open corpus: every question searched over all 6 documents\n")
    records = [json.loads(line) for line in (tmp_path / "predictions" / "naive.jsonl").open()]
    assert "Which dataset do they evaluate on?" in [r["question"] for r in records]
    assert all(r["scope"] is None for r in records)
    assert len({doc_id for r in records for doc_id, _, _ in r["evidence_spans"]}) > 1
    assert "scope" not in json.loads((tmp_path / "predictions" / "naive.settings.json").read_text())


def _record(failure: str = "", **details) -> dict:
    """A saved answer with the fields ``summarise`` reads; one generator call of 100 prompt tokens."""
    return {"failure": failure, "details": details, "exact_match": 0.0, "token_f1": 0.5, "contains_match": 1.0,
            "rouge_l": 0.5, "recall@5": 1.0, "seconds": 2.0,
            "usage": {"generator": {"calls": 1, "prompt_tokens": 100, "completion_tokens": 4, "failed_calls": 0}}}


def test_failures_repairs_and_failed_slates_reach_the_row_and_the_table() -> None:
    """A failed question is a failure; a question answered after every slate failed (LATTICE's all_slates_failed),
    after a slate with a missing score or a truncated tool call is a repair, each by kind; failed slates are
    counted with the slates they are among."""
    records = [_record(slates=3, failed_slates=3, all_slates_failed=1),
               _record(slates=2, failed_slates=0, missing=2, tool_failures={"truncated_call": 1}),
               _record("request_failed", slates=0, failed_slates=0)]
    row = summarise(records, 5)
    assert (row["n_questions"], row["answered"], row["failures"]) == (3, 2, {"request_failed": 1})
    assert row["repairs"] == {"failed_slates": 3, "all_slates_failed": 1, "missing": 2,
                              "tool_failures.truncated_call": 1}
    assert row["slates"] == {"slates": 5, "failed": 3}
    assert row["usage_total"]["generator"]["prompt_tokens"] == 300 and row["generator_tokens"] == 100.0
    table = pipeline_table({"recall_k": 5, "strategies": {"lattice": {**row, "costs_add_up": None}}})
    assert ("| 1/3 (request_failed 1) | failed_slates 3, missing 2, all_slates_failed 1, "
            "tool_failures.truncated_call 1 | 3/5 | - |") in table
    assert "| failed | repairs | failed slates | costs add up |" in table


class Refused:
    """A strategy whose server refuses its request (a 4xx): what a wrong role name gives every question."""

    name = "refused"

    def answer(self, question, client, scope=None):
        raise RequestRefused("slate scores", ClientError(404, "no role 'scorer'"))


class OtherCorpus:
    """A strategy whose index lacks the question's document (a LATTICE tree built over another corpus)."""

    name = "other-corpus"

    def answer(self, question, client, scope=None):
        raise ConfigError(f"lattice.tree has no leaf of the document(s) {', '.join(scope)}")


class Broken:
    """A strategy with a bug: one question's error is recorded, the run goes on."""

    name = "broken"

    def answer(self, question, client, scope=None):
        raise KeyError("chunk 7")


def test_a_refused_request_or_a_setup_error_stops_the_run_and_a_strategy_bug_is_recorded() -> None:
    question = QAExample("q1", "Who?", ["Ada"], [], "stand-in")
    with pytest.raises(RequestRefused, match="HTTP 404"):
        answer_question(Refused(), question, Client(SaysNo()), 5)
    with pytest.raises(ConfigError, match="no leaf of the document.s. qasper/p"):  # every question would fail alike
        answer_question(OtherCorpus(), question, Client(SaysNo()), 5, scope=["qasper/p"])
    record = answer_question(Broken(), question, Client(SaysNo()), 5)
    assert (record["failure"], record["failure_detail"]) == ("strategy_error", "KeyError: 'chunk 7'")


class SaysNo:
    """Stands in for a served judge that refuses everything, as SmolLM2-135M does (a real judge cannot be made to
    refuse on demand); the ``Backend`` of serving/client.py."""

    def __init__(self):
        self.prompts: list[str] = []

    def post(self, path, payload):
        self.prompts.append(payload["messages"][0]["content"])
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": "No, the"},
                             "finish_reason": "length"}], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}, 0


def test_qasper_evidence_is_the_papers_paragraphs_the_chunks_touch() -> None:
    """A sentence inside the second paragraph and a window over both give both paragraphs, each once, verbatim; an
    answer saved without spans (an earlier harness) is refused rather than written without evidence."""
    text = "Intro\n\nWe train a model. It works.\n\nResults are good."
    paper = Document("qasper/p", "P", text, {"paragraph_spans": [[7, 34], [36, 53]]})
    record = {"id": "q1", "prediction": "a model", "evidence_spans": [["qasper/p", 40, 53], ["qasper/p", 10, 45]]}
    assert qasper_predictions([record], [paper]) == [{"question_id": "q1", "predicted_answer": "a model",
                                                       "predicted_evidence": ["Results are good.",
                                                                              "We train a model. It works."]}]
    with pytest.raises(ConfigError, match="q0 was saved by an earlier harness"):
        qasper_predictions([{"id": "q0", "prediction": "x", "evidence_texts": ["We train"]}], [paper])


def test_a_judge_that_refuses_the_reference_itself_is_flagged() -> None:
    questions = [QAExample(f"q{i}", f"Who is {i}?", [f"Person {i}"], [], "stand-in") for i in range(7)]
    backend = SaysNo()
    sanity = judge_sanity(questions, Client(backend), JudgeConfig(role="scorer"))
    assert (sanity["reference_accepted"], sanity["asked"]) == (0, 5)
    assert "Reference answer: Person 0\nProposed answer: Person 0" in backend.prompts[0]
    row = {"n_questions": 7, "answered": 7, "llm_calls": 1, "llm_input_tokens": 1, "llm_output_tokens": 1,
           "generator_tokens": 1, "seconds": 1.0, "judge": 0.0, "costs_add_up": None}
    table = pipeline_table({"recall_k": 5, "strategies": {"naive": row}, "judge_sanity": sanity})
    assert "accepted the reference answer itself for 0 of 5 questions" in table
    assert "accepted" not in pipeline_table({"recall_k": 5, "strategies": {"naive": row},
                                             "judge_sanity": {**sanity, "reference_accepted": 5}})


@pytest.mark.parametrize("override, key", [("strategies=naive,graphrag", "strategies"), ("data=msmarco", "data"),
                                           ("strategies=lattice", "lattice.tree"), ("recall_k=0", "recall_k"),
                                           ("naive.k=0", "naive.k"), ("scope=paper", "scope: 'paper' is not a scope"),
                                           ("scope=document", "scope: document needs questions that are each")])
def test_bad_config_names_the_key(override: str, key: str, tmp_path: Path, capsys) -> None:
    assert main(["eval", "pipeline", "--config", CONFIG, f"out={tmp_path}", override]) == 2
    assert key in capsys.readouterr().err
