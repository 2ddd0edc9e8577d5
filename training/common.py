"""What every recipe needs and no recipe should own: LoRA settings as a peft config, resuming from the newest
checkpoint, and the final save with its ``overstory.json`` manifest and ``metrics.json``.

Recipes call these small functions; none of them imports another recipe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overstory.training.model_card import finish_checkpoint


@dataclass(frozen=True)
class LoraSettings:
    enabled: bool = True  # train a LoRA adapter (false: full fine-tuning)
    r: int = 16  # adapter rank
    alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    dropout: float = 0.05  # dropout on the adapter's input
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"])
    merge: bool = False  # write the merged full model to out/final instead of the adapter


def lora_config(settings: LoraSettings):
    """The peft ``LoraConfig`` for a causal LM, or None when LoRA is off (full fine-tuning).

    >>> lora_config(LoraSettings(r=4, alpha=8)).r, lora_config(LoraSettings(enabled=False))
    (4, None)
    """
    if not settings.enabled:
        return None
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=list(settings.target_modules), task_type="CAUSAL_LM")


def newest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest ``checkpoint-N`` folder the Trainer wrote under ``output_dir`` (what a rerun resumes from)."""
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(output_dir)) if Path(output_dir).is_dir() else None
    if last:
        print(f"resuming from {last}")
    return last


def final_eval_loss(trainer) -> float:
    """The trained model's validation loss: the one the Trainer logged at its last step where it evaluated there (at
    each epoch's end, and with each save under ``train.eval_at: save``), else a new pass. The same weights give the
    same figure; the pass made again cost the teacher's planner SFT 200 s of CPU."""
    state = trainer.state
    logged = [r["eval_loss"] for r in state.log_history if "eval_loss" in r and r.get("step") == state.global_step]
    return logged[-1] if logged else trainer.evaluate()["eval_loss"]


def size_metrics(model) -> dict[str, int]:
    """Parameters of a model, all and trainable (a LoRA adapter's only, under peft), for throughput figures such
    as MFU. Under DeepSpeed ZeRO-3 a rank holds a shard: ``ds_numel`` is the parameter's full size."""
    def numel(p) -> int:
        return int(getattr(p, "ds_numel", p.numel()))

    return {"params": sum(numel(p) for p in model.parameters()),
            "trainable_params": sum(numel(p) for p in model.parameters() if p.requires_grad)}


def save_final(trainer, tokenizer, out: str | Path, manifest: dict[str, Any], metrics: dict[str, Any],
               history: list[dict] | None = None, merge_lora: bool = False, data: dict[str, str] | None = None,
               push_to_hub: str = "") -> Path:
    """Write ``out/final`` (the model or its PEFT adapter, the tokenizer, the ``overstory.json`` manifest and the
    model card naming the ``data`` files, training/model_card.py) and ``out/metrics.json`` (``metrics`` plus the
    per-step ``history``); then upload ``out/final`` to the hub repo ``push_to_hub`` when one is named.

    ``trainer.save_model`` runs on every rank: under DeepSpeed ZeRO-3 the weights are sharded and only a call on
    all ranks gathers them (a rank-0 ``save_pretrained`` would write an empty or partial state dict). The other
    files are written by the main process. ``merge_lora`` replaces the adapter by the merged full model, made
    on the main process from the adapter just saved (so it works whatever the sharding was).
    """
    out, final = Path(out), Path(out) / "final"
    trainer.save_model(str(final))
    if not trainer.is_world_process_zero():
        return final
    if merge_lora:
        from peft import AutoPeftModelForCausalLM

        merged = AutoPeftModelForCausalLM.from_pretrained(final).merge_and_unload()
        for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
            (final / name).unlink(missing_ok=True)
        merged.save_pretrained(final)
    tokenizer.save_pretrained(final)
    write_manifest(final, {**manifest, "metrics": metrics})
    (out / "metrics.json").write_text(json.dumps({**metrics, "history": history or []}, indent=2))
    adapter = (final / "adapter_config.json").exists()
    finish_checkpoint(final, {**manifest, "adapter": adapter}, data or {}, metrics,
                      "peft" if adapter else "transformers", push_to_hub)
    return final


def write_manifest(folder: str | Path, manifest: dict[str, Any]) -> Path:
    """``overstory.json`` beside a checkpoint: base model, recipe, config, data hashes, metrics, tracking run."""
    path = Path(folder) / "overstory.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=2))
    return path
