"""`overstory data orion-tags` and `orion-tags-edit` against a scripted stand-in server: the config file loads, a
killed run resumes asking only for what is missing, other chunking settings are refused, and an edit of one
document's master tags re-embeds that document's paths alone. (The real built-in models run the job end to end in
tests/retrieval/test_orion.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from overstory.core.config import ConfigError, load_config
from overstory.core.failures import TooManyFailures
from overstory.core.records import Document, read_jsonl
from overstory.data_pipeline.fanout import failures_path, settings_path
from overstory.data_pipeline.orion_index import FALLBACKS_FILE, tag_and_index
from overstory.data_pipeline.orion_tags import (
    OrionTagEditConfig,
    OrionTagsConfig,
    apply_edit,
    edited_master,
    tags_folder,
)
from overstory.retrieval.orion.strategy import PROBE, load_vectors
from overstory.retrieval.orion.tagger import ChunkingConfig, TaggingConfig, chunk_document
from overstory.retrieval.orion.tags import (
    CHUNKS_FILE,
    MASTERS_FILE,
    TAGS_SETTINGS_FILE,
    ChunkTags,
    DocumentTags,
    load_tags,
)
from overstory.serving.client import Client, ClientError

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [
    Document("t/paris", "Paris", "Paris is the capital of France. The Eiffel Tower stands in Paris."),
    Document("t/nile", "Nile", "The Nile is the longest river in Africa. It flows through Egypt."),
    Document("t/alps", "Alps", "The Alps are a mountain range in Europe. Mont Blanc is their highest peak."),
]
CHUNKING = ChunkingConfig(chunk_chars=40)  # two chunks a document
TAGGING = TaggingConfig(concurrency=1)


class KilledRun(KeyboardInterrupt):
    """What Ctrl-C raises: a BaseException, so nothing on the way catches it as an error."""


class StandIn:
    """Stands in for the served generator and embedder (the ``Backend`` of serving/client.py): the test kills a run
    after a given number of tagging replies and counts what a rerun asks for, which needs replies on demand, not a
    model's; it fails every request whose prompt holds ``down_for``, and answers the one that holds ``hold[0]`` only
once a record is in the file ``hold[1]``, which a real server does not do on demand.
Master tags are the title's words; paragraph tags are read off the passage (its first words,
    its first capitalised name); an embedding is the text's
    length and vowel count (distinct enough to tell rows apart). Chat prompts and embedded texts are kept."""

    def __init__(self, kill_after: int | None = None, down_for: str = "", hold: tuple[str, Path] | None = None):
        self.kill_after, self.down_for, self.hold = kill_after, down_for, hold
        self.prompts: list[str] = []
        self.embedded: list[str] = []

    def post(self, path, payload):
        if path == "/v1/embeddings":
            self.embedded += payload["input"]
            data = [{"index": i, "embedding": [len(t), sum(t.count(v) for v in "aeiou"), 1.0]}
                    for i, t in enumerate(payload["input"])]
            return {"data": data, "usage": {"prompt_tokens": 0, "total_tokens": 0}}, 0
        if self.kill_after is not None and len(self.prompts) == self.kill_after:
            raise KilledRun()
        prompt = payload["messages"][0]["content"]
        self.prompts.append(prompt)
        if self.down_for and self.down_for in prompt:  # a request the server never answers (after the retries)
            raise ClientError(503, "server busy")
        if self.hold and self.hold[0] in prompt:  # answered only once another document's tags are on disk
            deadline = time.monotonic() + 30
            while len(self.hold[1].read_text().splitlines()) < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        if payload["response_format"]["json_schema"]["name"] == "master_tags":
            title = prompt.split("Title: ")[1].splitlines()[0]
            reply = {"tags": [title, "Geography"]}
        else:
            words = prompt.split("Passage: ")[1].split()
            subject = next(w.strip(".") for w in words if len(w) > 3 and w[0].isupper() and w != "The")
            reply = {"gist": " ".join(words[:3]), "subjects": subject, "domain": "geography"}
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps(reply)},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30}}, 0

    def get(self, path):
        return [{}]

    def close(self):
        pass


def passages(backend: StandIn) -> list[str]:
    """The chunk texts the paragraph prompts asked about, in order."""
    return [p.split("Passage: ")[1].split("\n\nReply")[0] for p in backend.prompts if "Passage: " in p]


def test_the_config_file_loads_and_bad_values_name_their_key():
    config = load_config(OrionTagsConfig, ROOT / "configs/data/orion_tags.yaml", ["out=/tmp/x", "corpus.limit_docs=3"])
    assert (config.chunking.chunk_chars, config.chunking.overlap_chars, config.tagging.max_master_tags) == (500, 0, 5)
    assert config.serve.roles["generator"].kind == "chat" and config.corpus.limit_docs == 3
    with pytest.raises(ConfigError, match="chunking.chunk_chars"):
        load_config(OrionTagsConfig, ROOT / "configs/data/orion_tags.yaml", ["chunking.chunk_chars=0"])
    with pytest.raises(ConfigError, match="tagging.concurrency"):
        load_config(OrionTagsConfig, ROOT / "configs/data/orion_tags.yaml", ["tagging.concurrency=0"])
    assert config.max_failure_share == 0.0


def test_a_killed_run_resumes_asking_only_for_what_is_missing(tmp_path):
    chunks = [c for d in DOCUMENTS for c in chunk_document(d, CHUNKING)]
    assert len(chunks) == 6
    killed = StandIn(kill_after=3 + 2)  # the three documents' master tags, then two chunks
    with pytest.raises(KilledRun):
        tag_and_index(DOCUMENTS, Client(killed), tmp_path, CHUNKING, TAGGING)
    assert [r["id"] for r in read_jsonl(tmp_path / CHUNKS_FILE)] == [c.id for c in chunks[:2]]
    with (tmp_path / CHUNKS_FILE).open("a") as torn:  # the half-written line a kill can leave
        torn.write('{"id": "t/nile#w0", "doc_id": "t/ni')

    backend = StandIn()
    report = tag_and_index(DOCUMENTS, Client(backend), tmp_path, CHUNKING, TAGGING)
    assert passages(backend) == [c.text for c in chunks[2:]]  # no master tags, no finished chunk asked again
    assert len(backend.prompts) == 4 and report["tagging"]["llm_calls"] == 4
    tagging = report["tagging"]
    assert (tagging["documents_skipped_done"], tagging["chunks_skipped_done"], tagging["chunks_llm"]) == (3, 2, 4)
    assert tagging["prompt_tokens"] == 4 * 20 and tagging["completion_tokens"] == 4 * 10
    masters, records = load_tags(tmp_path)
    assert [r.id for r in records] == [c.id for c in chunks] and set(masters) == {d.id for d in DOCUMENTS}
    assert records[2].tags == ["The Nile is", "Nile", "geography"] and records[2].source == "llm"
    assert report["index"] == {"chunks": 6, "embedded": 12, "seconds": report["index"]["seconds"]}
    assert json.loads((tmp_path / "build.json").read_text())["tagging"]["llm_calls"] == 4

    again = StandIn()
    report = tag_and_index(DOCUMENTS, Client(again), tmp_path, CHUNKING, TAGGING)
    assert again.prompts == [] and again.embedded == [PROBE]  # tags and vectors are all on disk
    assert report["tagging"]["chunks_skipped_done"] == 6 and report["index"]["embedded"] == 0
    assert not (tmp_path / FALLBACKS_FILE).read_text()


def test_the_tags_are_kept_in_the_corpus_order_whichever_request_finishes_first(tmp_path):
    backend = StandIn(hold=("Title: Paris", tmp_path / MASTERS_FILE))  # Paris's master tags come after the others'
    tag_and_index(DOCUMENTS, Client(backend), tmp_path, CHUNKING, TaggingConfig(concurrency=3))
    assert [r["id"] for r in read_jsonl(tmp_path / MASTERS_FILE)] == [d.id for d in DOCUMENTS]
    assert [r["id"] for r in read_jsonl(tmp_path / CHUNKS_FILE)] == [c.id for d in DOCUMENTS
                                                                    for c in chunk_document(d, CHUNKING)]


def test_other_chunking_or_tagging_settings_are_refused(tmp_path):
    tag_and_index(DOCUMENTS[:1], Client(StandIn()), tmp_path, CHUNKING, TAGGING)
    # recorded where the strategy reads how the folder's chunks were cut and tagged (retrieval/orion/tags.py)
    assert settings_path(tmp_path / CHUNKS_FILE) == tmp_path / TAGS_SETTINGS_FILE
    assert json.loads((tmp_path / TAGS_SETTINGS_FILE).read_text())["chunking"]["chunk_chars"] == 40
    with pytest.raises(ConfigError, match=r"\(chunking\.chunk_chars differ from .*chunks\.settings\.json\)"):
        tag_and_index(DOCUMENTS[:1], Client(StandIn()), tmp_path, ChunkingConfig(chunk_chars=41), TAGGING)
    with pytest.raises(ConfigError, match=r"tagging\.max_master_tags differ"):
        tag_and_index(DOCUMENTS[:1], Client(StandIn()), tmp_path, CHUNKING, TaggingConfig(max_master_tags=3))
    tag_and_index(DOCUMENTS[:1], Client(StandIn()), tmp_path, CHUNKING, TaggingConfig(concurrency=3))  # how it runs


def test_items_whose_requests_failed_are_listed_not_written_and_tagged_by_the_rerun(tmp_path):
    """The Nile's master-tag requests fail: the document is listed as failed, its chunks wait for it, nothing is
    indexed (TooManyFailures); with the failures allowed, the rest is indexed; a rerun tags the Nile and its chunks."""
    with pytest.raises(TooManyFailures, match=r"orion-tags: 1 of 7 items failed") as failed:
        tag_and_index(DOCUMENTS, Client(StandIn(down_for="Title: Nile")), tmp_path, CHUNKING, TAGGING)
    assert failed.value.counts["documents_llm"] == 2 and failed.value.counts["chunks_llm"] == 4
    (failure,) = read_jsonl(failures_path(tmp_path / CHUNKS_FILE))
    assert failure["id"] == "t/nile" and failure["error"] == "2 of 2 requests failed after the client's retries"
    assert "503: server busy" in failure["raw"] and not (tmp_path / "build.json").exists()
    assert "t/nile" not in {r["id"] for r in read_jsonl(tmp_path / MASTERS_FILE)}
    assert not (tmp_path / FALLBACKS_FILE).read_text()  # a failed request is no fallback

    report = tag_and_index(DOCUMENTS, Client(StandIn(down_for="Title: Nile")), tmp_path, CHUNKING, TAGGING,
                           max_failure_share=1.0)
    tagging = report["tagging"]
    assert (tagging["failed"], tagging["chunks_waiting"], tagging["request_failures"]) == (1, 2, 2)
    assert report["index"]["chunks"] == 4  # Paris's and the Alps' chunks

    backend = StandIn()
    report = tag_and_index(DOCUMENTS, Client(backend), tmp_path, CHUNKING, TAGGING)
    assert len(backend.prompts) == 3 and report["tagging"]["failed"] == 0  # the Nile's master tags, its two chunks
    assert report["index"]["chunks"] == 6 and not failures_path(tmp_path / CHUNKS_FILE).read_text()


@pytest.fixture
def tagged(tmp_path) -> Path:
    tag_and_index(DOCUMENTS, Client(StandIn()), tmp_path, CHUNKING, TAGGING)
    return tmp_path


def test_an_edit_reembeds_one_documents_paths_alone(tagged):
    before = load_vectors(tagged)
    config = OrionTagEditConfig(tags=str(tagged / MASTERS_FILE), document="t/nile", add=["Africa", "Geography"],
                                remove=["geography"])
    folder = tags_folder(config.tags)
    edited = edited_master(load_tags(folder)[0], config)
    assert edited == DocumentTags("t/nile", "Nile", ["Nile", "Africa", "Geography"], "human")
    backend = StandIn()
    report = apply_edit(folder, edited, Client(backend))
    assert backend.embedded == [PROBE, "Nile, Africa, Geography > The Nile is > Nile > geography",
                                "Nile, Africa, Geography > It flows through > Egypt > geography"]
    assert report == {"document": "t/nile", "before": ["Nile", "Geography"], "after": ["Nile", "Africa", "Geography"],
                      "embedded": 2, "chunks": 2}
    masters, records = load_tags(folder)
    assert list(masters) == ["t/paris", "t/nile", "t/alps"] and masters["t/nile"] == edited
    assert masters["t/paris"].tags == ["Paris", "Geography"] and masters["t/paris"].source == "llm"
    after = load_vectors(folder)
    kept = [s for s in before if not s.startswith("Nile, Geography >")]
    assert all(np.array_equal(before[s], after[s]) for s in kept)
    assert set(after) == set(kept) | {"Nile, Africa, Geography > The Nile is > Nile > geography",
                                      "Nile, Africa, Geography > It flows through > Egypt > geography"}
    rebuilt = StandIn()
    apply_edit(folder, edited_master(masters, OrionTagEditConfig(str(folder), "t/nile", remove=["africa"])),
               Client(rebuilt))
    assert rebuilt.embedded[0] == PROBE and len(rebuilt.embedded) == 3
    assert all(r.tags == t.tags for r, t in zip(records, load_tags(folder)[1], strict=True))  # chunks untouched


@pytest.mark.parametrize("overrides, key", [
    ({"document": "t/unknown", "add": ["x"]}, "document: 't/unknown' is not a document"),
    ({"document": "t/nile", "remove": ["Sahara"]}, "remove: 'Sahara' is not a master tag"),
    ({"document": "t/nile", "remove": ["Nile", "geography"]}, "remove: the edit would leave"),
])
def test_a_bad_edit_names_its_key(tagged, overrides, key):
    config = OrionTagEditConfig(tags=str(tagged), **overrides)
    with pytest.raises(ConfigError, match=key):
        edited_master(load_tags(tags_folder(config.tags))[0], config)


def test_edit_configs_name_their_key(tmp_path):
    with pytest.raises(ConfigError, match="add, remove"):
        OrionTagEditConfig(tags="x", document="t/nile")
    with pytest.raises(ConfigError, match="add: a tag must hold a word"):
        OrionTagEditConfig(tags="x", document="t/nile", add=[" "])
    with pytest.raises(ConfigError, match="tags: .* holds no masters.jsonl"):
        tags_folder(str(tmp_path))


def test_chunk_records_keep_document_offsets(tagged):
    texts = {d.id: d.text for d in DOCUMENTS}
    records = list(read_jsonl(tagged / CHUNKS_FILE, ChunkTags))
    assert all(texts[r.doc_id][r.start:r.end] == r.text and len(r.text) <= 40 for r in records)
