"""``overstory serve --model DIR`` / ``--adapter DIR``: a trained checkpoint served without a roles file, its role
read from the manifest beside it (serving/checkpoint_roles.py), and the folders that cannot be served so refused.

The planner adapter is the session's real planner_sft output; the cross-encoder scorer is the untrained tiny MiniLM
one of ``cross_encoder_fixture`` with the manifest distill_scorer writes for a cross-encoder student (training it
would take minutes and these tests check serving, not scores); the compressors are saved by the recipes' own
save functions.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai import OpenAI
from sentence_transformers import CrossEncoder

from overstory.cli import main
from overstory.core.config import ConfigError, load_config
from overstory.models.compressor import SetCompressor, SetCompressorConfig, save_checkpoint
from overstory.models.registry import MINILM, SMOLLM2, load_sentence_encoder
from overstory.models.text_compressor import save_text_compressor
from overstory.serving.checkpoint_roles import checkpoint_role
from overstory.serving.client import Client
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import serve_in_background
from overstory.training.common import write_manifest
from tests.serving.cross_encoder_fixture import build_tiny_cross_encoder

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Question: Which river flows through Paris?\nAnswer:"
QUERY, DOCS = "Which city hosted the 1936 Olympics?", ["Berlin hosted the 1936 Summer Olympics.", "Paris is in France."]


@pytest.fixture(scope="module")
def ce_scorer(tmp_path_factory) -> str:
    """A cross-encoder folder with distill_scorer's manifest for a cross-encoder student."""
    folder = build_tiny_cross_encoder(tmp_path_factory.mktemp("ce_scorer") / "final")
    write_manifest(folder, {"kind": "scorer", "student": "cross_encoder", "base_model": MINILM,
                            "recipe": "distill_scorer"})
    return folder


@pytest.fixture(scope="module")
def set_compressor(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("set_compressor") / "best"
    return str(save_checkpoint(SetCompressor(SetCompressorConfig(encoder=MINILM)), folder, {}))


def test_each_manifest_kind_gives_its_role(ce_scorer: str, set_compressor: str, planner_adapter: str,
                                           tmp_path: Path) -> None:
    embedder = RoleConfig(model=MINILM, kind="embedding")
    assert ServeConfig(model=ce_scorer).roles == {"scorer": RoleConfig(model=ce_scorer, kind="cross-encoder"),
                                                  "embedder": embedder}
    assert ServeConfig(model=set_compressor).roles == {
        "compressor": RoleConfig(model=set_compressor, kind="compression"), "embedder": embedder}
    base = json.loads((Path(planner_adapter) / "overstory.json").read_text())["base_model"]
    assert base == SMOLLM2  # the recipe's manifest names the base model the adapter is served on
    assert ServeConfig(adapter=planner_adapter).roles == {
        "planner": RoleConfig(model=SMOLLM2, adapter=planner_adapter), "embedder": embedder}
    # a text compressor's vectors live in its encoder's space: that encoder is the stack's embedder
    text = str(save_text_compressor(load_sentence_encoder(MINILM), tmp_path / "text", "some/encoder", {}))
    assert ServeConfig(model=text).roles["embedder"] == RoleConfig(model="some/encoder", kind="embedding")


def test_an_llm_scorer_student_is_a_chat_scorer(tmp_path: Path) -> None:
    """distill_scorer's LLM student, merged (``lora.merge: true``): a full model folder, a chat scorer."""
    write_manifest(tmp_path, {"kind": "scorer", "student": "llm", "base_model": SMOLLM2, "adapter": False})
    found = checkpoint_role(str(tmp_path), adapter=False)
    assert (found.role, found.kind, found.model, found.adapter) == ("scorer", "chat", str(tmp_path), "")


def test_a_rebuilt_config_keeps_its_checkpoint_roles(ce_scorer: str) -> None:
    """``dataclasses.replace`` (what background stacks do with port=0) passes the derived roles in again."""
    config = ServeConfig(model=ce_scorer)
    assert dataclasses.replace(config, port=0).roles == config.roles


def _adapter_lookalike(folder: Path) -> str:
    """A folder with an adapter_config.json and a planner manifest: enough for the checks made before loading."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": SMOLLM2}))
    write_manifest(folder, {"kind": "planner", "base_model": SMOLLM2, "adapter": True})
    return str(folder)


@pytest.mark.parametrize(("case", "message"), [
    ("no_manifest", "has no overstory.json, the manifest every overstory recipe writes"),
    ("no_kind", "overstory.json names no role (kind: None"),
    ("adapter_as_model", "holds a LoRA adapter (adapter_config.json): serve it with --adapter"),
    ("model_as_adapter", "has no adapter_config.json, so it is a full model"),
    ("missing", "no such checkpoint folder"),
])
def test_folders_that_cannot_be_served_are_refused(case: str, message: str, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "ckpt"
    if case == "no_manifest":
        build_tiny_cross_encoder(folder)
    elif case == "no_kind":
        write_manifest(folder, {"base_model": MINILM})
    elif case in ("adapter_as_model", "model_as_adapter"):
        _adapter_lookalike(folder)
    flag = "--adapter" if case in ("model_as_adapter", "missing") else "--model"
    if case == "model_as_adapter":
        (folder / "adapter_config.json").unlink()
    assert main(["serve", flag, str(folder), "port=0", "tracking.backend=none"]) == 2
    error = capsys.readouterr().err
    assert message in error
    if case in ("no_manifest", "no_kind"):  # and how to serve it anyway
        assert "with a roles file" in error and "(overstory serve --config FILE, with roles: {" in error


def test_a_role_the_config_already_serves_is_refused(tmp_path: Path) -> None:
    adapter = _adapter_lookalike(tmp_path / "planner")
    with pytest.raises(ConfigError, match=r"adapter=.* serves the planner role, which is already served by "
                                          r"builtin:smollm2-135m-instruct; leave roles.planner out"):
        load_config(ServeConfig, ROOT / "configs/serve/local.yaml", [f"adapter={adapter}"])
    merged = tmp_path / "planner_merged"  # a full-model planner (a merged LoRA): two checkpoints for one role
    write_manifest(merged, {"kind": "planner", "base_model": SMOLLM2, "adapter": False})
    with pytest.raises(ConfigError, match=f"adapter={adapter} serves the planner role, which is already served by "
                                          f"{merged}"):
        ServeConfig(model=str(merged), adapter=adapter)


def test_a_set_compressor_answers_compress(set_compressor: str) -> None:
    with serve_in_background(ServeConfig(port=0, model=set_compressor)) as url:
        client = Client.from_url(url)
        groups = [["The Normans were a people of Normandy.", "They descended from Norse raiders."]]
        compressed = client.compress("compressor", groups=groups)
        # an untrained set compressor is the mean of its children's embeddings, from the added MiniLM embedder
        np.testing.assert_allclose(compressed[0], client.embed("embedder", groups[0]).mean(0), atol=1e-5)


@pytest.fixture(scope="module")
def served(planner_adapter: str, ce_scorer: str) -> Iterator[str]:
    """``overstory serve --adapter PLANNER --model SCORER`` as a user runs it, on a free port, with a base-model
    generator added by an override; yields the printed base URL and stops the server with SIGTERM."""
    command = [sys.executable, "-m", "overstory.cli", "serve", "--adapter", planner_adapter, "--model", ce_scorer,
               f"roles.generator.model={SMOLLM2}", "port=0", "tracking.backend=none"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    try:
        for line in process.stdout:  # the line that names the URL comes once every model has loaded
            lines.append(line)
            if found := re.search(r"serving .* on (http://\S+)/v1", line):
                yield found.group(1)
                break
        else:
            pytest.fail("overstory serve exited before serving:\n" + "".join(lines))
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_serve_adapter_and_model_answer_over_http(served: str, ce_scorer: str) -> None:
    openai = OpenAI(base_url=f"{served}/v1", api_key="unused")
    assert {model.id for model in openai.models.list()} == {"generator", "planner", "scorer", "embedder"}
    reply = openai.chat.completions.create(model="planner", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Plan: who wrote Hamlet?"}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    # the adapter, not the bare base model, answers for the planner
    first = {role: openai.completions.create(model=role, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0)
             for role in ("generator", "planner")}
    logprobs = [first[role].choices[0].logprobs.token_logprobs[0] for role in ("generator", "planner")]
    assert abs(logprobs[0] - logprobs[1]) > 1e-3
    # the cross-encoder scores as sentence-transformers scores with the folder's own activation
    rerank = httpx.post(f"{served}/v1/rerank", json={"model": "scorer", "query": QUERY, "documents": DOCS},
                        timeout=30).json()
    scores = {r["index"]: r["relevance_score"] for r in rerank["results"]}
    expected = CrossEncoder(ce_scorer, device="cpu").predict([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose([scores[0], scores[1]], expected, atol=1e-5)
    assert len(openai.embeddings.create(model="embedder", input=["a sentence"]).data[0].embedding) == 384
