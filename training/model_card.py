"""The model card of a final checkpoint (``README.md`` in its folder, written with huggingface_hub's ``ModelCard``)
and its upload to the hub (``push_to_hub: <repo id>`` in a recipe's config), so a checkpoint travels with what
made it: the base model and its licence, the data files and their sha256, the recipe with its command and full
config, and the final metrics the recipe measured.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import HfApi, ModelCard, ModelCardData

from overstory.models.registry import MINILM, QWEN_CODER, SMOLLM2

# the hub id and licence of the built-in models (models/registry.py) and of the hub models the configs name
BASE_MODELS: dict[str, tuple[str, str]] = {
    SMOLLM2: ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    QWEN_CODER: ("Qwen/Qwen2.5-Coder-1.5B-Instruct", "apache-2.0"),
    MINILM: ("sentence-transformers/all-MiniLM-L6-v2", "apache-2.0"),
    "Qwen/Qwen2.5-1.5B-Instruct": ("Qwen/Qwen2.5-1.5B-Instruct", "apache-2.0"),
}


def hub_base(base_model: str) -> tuple[str | None, str | None]:
    """(hub id, licence) of a base model: known ones from ``BASE_MODELS``, another hub id with an unknown licence,
    and (None, None) for a local folder.

    >>> hub_base("builtin:smollm2-135m-instruct"), hub_base("org/model"), hub_base("/data/my-model")
    (('HuggingFaceTB/SmolLM2-135M-Instruct', 'apache-2.0'), ('org/model', None), (None, None))
    """
    if base_model in BASE_MODELS:
        return BASE_MODELS[base_model]
    if base_model.count("/") == 1 and not base_model.startswith((".", "/", "~")) and not Path(base_model).exists():
        return base_model, None
    return None, None


def file_sha256(path: str | Path) -> str:
    """The whole file's sha256 (the manifests keep a 16-character prefix; a card names the data exactly)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def launch_command() -> str:
    """The command line this process was started with (the program by its name, not its path on this machine)."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def card_text(manifest: dict[str, Any], data: dict[str, str], metrics: dict[str, Any]) -> str:
    """The card's body: what the checkpoint is, its data with hashes, how it was trained, metrics, licence."""
    base, recipe = manifest.get("base_model", ""), manifest["recipe"]
    hub_id, licence = hub_base(base)
    rows = "\n".join(f"| `{key}` | `{path}` | `{file_sha256(path)}` |" for key, path in data.items())
    scalars = "\n".join(f"| {key} | {value} |" for key, value in metrics.items()
                        if isinstance(value, (int, float, str, bool)) or value is None)
    kind = "a PEFT (LoRA) adapter on" if manifest.get("adapter") else "a model trained from"
    return f"""
# overstory {recipe}: {manifest.get('kind', 'model')}

{kind} `{base}`{f' ([{hub_id}](https://huggingface.co/{hub_id}))' if hub_id and hub_id != base else ''}, trained by
overstory's `{recipe}` recipe. `overstory.json` beside this card holds the same facts for programs.

## Data

| config key | file | sha256 |
|---|---|---|
{rows}

## Training

Launched as:

```
{launch_command()}
```

The whole config (save it as a YAML file and run `overstory train {recipe} --config FILE` to train it again):

```yaml
{yaml.safe_dump(manifest.get('config', {}), sort_keys=False).strip()}
```

## Metrics

| metric | value |
|---|---|
{scalars}

## Licence

{f'{licence}, the licence of the base model {hub_id}.' if licence else
 f'That of the base model `{base}` (not known to overstory: see its own card).'}
"""


def write_card(folder: str | Path, manifest: dict[str, Any], data: dict[str, str], metrics: dict[str, Any],
               library: str) -> Path:
    """``folder/README.md``: hub metadata (base model, licence, library, tags) and ``card_text``. ``data`` maps the
    config keys of the data files to their paths; ``library``: what loads the folder (peft, transformers, ...)."""
    hub_id, licence = hub_base(manifest.get("base_model", ""))
    metadata = ModelCardData(base_model=hub_id, license=licence, library_name=library,
                             tags=["overstory", manifest["recipe"], str(manifest.get("kind", "model"))])
    card = ModelCard(f"---\n{metadata.to_yaml()}\n---\n{card_text(manifest, data, metrics)}")
    path = Path(folder) / "README.md"
    card.save(path)
    return path


def push_folder(folder: str | Path, repo_id: str, recipe: str) -> str:
    """Upload ``folder`` (the final checkpoint with its card) to the hub model repo ``repo_id``, creating it if
    needed; returns the commit's URL. A failure (offline, no token) says where the checkpoint is."""
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                   commit_message=f"overstory {recipe}: {Path(folder).name}")
    except Exception as exc:  # the hub's errors are many (offline, auth, HTTP); each is reported the same way
        raise RuntimeError(f"push_to_hub {repo_id!r} failed ({exc.__class__.__name__}: {exc}); the checkpoint is "
                           f"saved in {folder}: upload it later with `hf upload {repo_id} {folder}`") from exc
    print(json.dumps({"pushed": str(folder), "repo": repo_id, "commit": str(commit)}))
    return str(commit)


def name_adapter_base(folder: str | Path, base_model: str) -> None:
    """Point a saved PEFT adapter's ``base_model_name_or_path`` at its base model's hub id (a built-in's upstream
    id, or the hub id it was trained from), not at the folder this machine loaded it from: PEFT and transformers
    load the base from that field wherever the adapter travels. A base known only as a local folder keeps its name.
    overstory itself reads the exact base (a ``builtin:`` name) from the ``overstory.json`` manifest beside it."""
    path = Path(folder) / "adapter_config.json"
    if not path.exists():
        return
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = hub_base(base_model)[0] or base_model
    scratch = path.with_suffix(".json.tmp")
    scratch.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    scratch.replace(path)


def finish_checkpoint(folder: str | Path, manifest: dict[str, Any], data: dict[str, str], metrics: dict[str, Any],
                      library: str, push_to_hub: str = "") -> Path:
    """A final checkpoint's adapter config named for travel (``name_adapter_base``) and card, then its upload when
    ``push_to_hub`` names a repo; returns the card's path."""
    if manifest.get("base_model"):
        name_adapter_base(folder, manifest["base_model"])
    card = write_card(folder, manifest, data, metrics, library)
    if push_to_hub:
        push_folder(folder, push_to_hub, manifest["recipe"])
    return card
