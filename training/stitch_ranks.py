"""STITCH across the processes of ``accelerate launch`` (DDP, DeepSpeed ZeRO-2/3), and in one process alike.

    accelerate launch --config_file configs/accelerate/cpu-2proc-zero2.yaml -m overstory.cli train stitch \
        --config configs/train/stitch.yaml
    accelerate launch --config_file configs/accelerate/cpu-2proc-zero3.yaml -m overstory.cli train stitch \
        --config configs/train/stitch.yaml

What a STITCH step needs beyond one process, and how it is done here:

- **The same routing on every rank.** The routing rollouts are split over the ranks (rank r rolls out prompts r,
  r + world, ...) and gathered, so every rank holds every completion; routing is a pure function of the draw (seeded
  by the step), the completions, the traces and the success rate, so every rank sorts the questions the same way.
  Split-and-gather rather than drawn on rank 0 and broadcast: the rollouts are a step's largest cost outside the
  updates, and split they take 1/world of the time, with every rank holding the whole policy anyway.
  Each rank's routing is then reduced to a digest, the digests are gathered and compared: a disagreement stops the
  run (the ranks would otherwise train on different buffers) and the step log shows every rank's digest.
- **ZeRO-3: one policy, partitioned, across the updates.** The first update's engine partitions the policy's
  parameters (each rank keeps its shard); each later update's engine takes them as they are, which is DeepSpeed's
  own path for a model built under ``zero.Init`` (its ``_convert_to_zero_parameters`` converts only parameters not
  yet partitioned), once the previous engine is destroyed (``retire``: its hooks would otherwise fire twice). What
  needs the whole weights gathers them for the moment it needs them, with DeepSpeed's ``GatheredParameters``: the
  routing rollouts (TRL's ``unwrap_model_for_generation``, as its trainers do), the weight change a GRPO update
  reports and the adapter digest (``gathered``), the save (the Trainer's ``save_model``, which under ZeRO-3 with a
  PEFT model gathers the trainable weights onto rank 0; every rank calls it). The other design, gathering the weights
  out of each engine and rebuilding the policy for the next update, would copy the whole model once per update and
  give up ZeRO-3's partitioned parameters between updates, for nothing the partitioned policy cannot do.
  Adam's moments are carried as under ZeRO-2, each rank its shard (the same trainable parameters and ranks give
  every engine the same partitioning); ZeRO-3's loader restores the master weights from the saved state, so they are
  replaced by the new engine's own (made from the current weights) before loading. Run on two CPU processes with
  the parameters on the device (tests/training/test_stitch_distributed.py) and offloaded to CPU
  (``offload_param_device: cpu``, two steps, tried by hand); NVMe offload has not been run.
- **The updates are the trainers' own.** Each GRPO update and SFT injection is a TRL trainer built around the one
  policy, which makes its own optimizer (under DeepSpeed the engine wraps it: DeepSpeed ignores an optimizer handed
  to the Trainer). ``CarryOptimizerState`` keeps Adam's moments across the updates of one kind: the optimizer's state
  at the end of an update is kept (each rank its shard under ZeRO) and loaded into the next update's optimizer at its
  start, the master weights refreshed from the current ones (``load_from_fp32_weights=False``: an SFT injection
  between two GRPO updates moved them) and the learning rate left to the new update's scheduler.
- **Saves.** The weights are saved by every rank through the last update's Trainer (``save_model``, as the other
  recipes save under DeepSpeed); before any update the main process saves them. Each step logs every rank's digest
  of the adapter it holds (``adapter_by_rank``; gathered under ZeRO-3), which the saved adapter's digest equals.
  Each rank writes its own optimizer shards and RNG state; the main process writes the rest and swaps the step in
  (``training/checkpoint_state.py``), between barriers.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import DistributedType
from peft import get_peft_model_state_dict
from transformers import TrainerCallback

from overstory.core.config import ConfigError
from overstory.training.distributed import cpu_ddp, process_group_backend

# (prompts, number of rollouts each) -> completions, prompt by prompt
RolloutFn = Callable[[list[list[dict[str, str]]], int], list[list[str]]]
# the key of ZeRO-3's master weights in its optimizer state (deepspeed.checkpoint.constants; deepspeed is optional)
FP32_FLAT_GROUPS = "fp32_flat_groups"
# what a ZeRO-3 engine sets on each module and keeps after its destroy (deepspeed/runtime/zero/parameter_offload.py)
ZERO3_MODULE_FUNCTIONS = ("pre_bwd_fn", "post_bwd_fn")


def process_state() -> PartialState:
    """The launch's process state, joining the process group on first use (gloo on a machine without CUDA), so
    that the routing rollouts of step 1 can be gathered before any Trainer has joined it. A launch without CUDA and
    without DeepSpeed (torchrun, or accelerate's multi-GPU launcher on CPUs) is DDP over gloo: accelerate calls it
    MULTI_CPU only when told ``cpu``, and would otherwise leave every rank training alone; the Trainers share the
    state made here."""
    return PartialState(cpu=cpu_ddp(), backend=process_group_backend())


def launch_record() -> dict[str, Any]:
    """What the saved optimizer shards depend on: how many processes, and whether DeepSpeed shards the optimizer and
    at which ZeRO stage (ZeRO-3's shards hold another layout than ZeRO-1/2's)."""
    state = process_state()
    deepspeed = state.distributed_type == DistributedType.DEEPSPEED
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "") if deepspeed else ""
    return {"world_size": state.num_processes, "deepspeed": deepspeed, "zero_stage": stage}


def check_launch(saved: dict | None, folder: Path) -> None:
    """Refuse to resume a run saved under another launch (its optimizer shards are per rank and per backend)."""
    now = launch_record()
    if saved is not None and saved != now:
        raise ConfigError(f"{folder} was saved by a run of {_launch_words(saved)}; this launch has "
                          f"{_launch_words(now)}. Resume it with the launch it was made with, or choose another out= "
                          f"to start afresh")


def _launch_words(record: dict) -> str:
    return (f"{record['world_size']} process(es) (DeepSpeed: {record['deepspeed']}, "
            f"ZeRO stage: {record.get('zero_stage') or '-'})")


def check_generations(num_generations: int) -> None:
    """Every GRPO group is split evenly over the ranks: G must be a multiple of the number of processes."""
    world = process_state().num_processes
    if num_generations % world:
        raise ConfigError(f"stitch.num_generations ({num_generations}) must be a multiple of the number of "
                          f"processes ({world}): each question's rollouts are split evenly over the ranks")


def grpo_shape(num_generations: int, n_prompts: int) -> dict[str, int]:
    """A GRPO update's batch shape: one generation batch of G rollouts of each of ``n_prompts`` prompts and one
    optimizer step over it. In one process a micro-batch per prompt (G rollouts), accumulated; across ranks each
    rank's micro-batch is its share of the whole batch, not accumulated, because a DeepSpeed config that gives
    gradient_accumulation_steps as a number (cpu-2proc-zero2.yaml: 1) must match it. DAPO normalises the loss by the
    batch's completion tokens, so the gradient is the same either way.

    >>> grpo_shape(4, 3)
    {'per_device_train_batch_size': 4, 'gradient_accumulation_steps': 3}
    """
    world = process_state().num_processes
    if world == 1:
        return {"per_device_train_batch_size": num_generations, "gradient_accumulation_steps": n_prompts}
    return {"per_device_train_batch_size": num_generations * n_prompts // world, "gradient_accumulation_steps": 1}


def sft_batch(batch_size: int, n_traces: int) -> int:
    """Traces per rank in an SFT step: the global batch stays ``min(batch_size, n_traces)`` across ranks."""
    return max(1, math.ceil(min(batch_size, n_traces) / process_state().num_processes))


def split_rollout(rollout: RolloutFn) -> RolloutFn:
    """``rollout`` over the ranks: rank r rolls out prompts r, r + world, ...; every rank gets every completion, in
    the prompts' order. Every rank must call it with the same prompts (they do: the draw and routing agree)."""
    state = process_state()
    if state.num_processes == 1:
        return rollout

    def shared(prompts: list[list[dict[str, str]]], n: int) -> list[list[str]]:
        world, rank = state.num_processes, state.process_index
        mine = rollout(prompts[rank::world], n)
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, mine)
        completions: list[Any] = [None] * len(prompts)
        for r, part in enumerate(parts):
            completions[r::world] = part
        return completions

    return shared


def routing_digest(rl: list[dict], imitation: list[dict], counts: dict[str, Any]) -> str:
    """A short digest of a step's routing: the RL buffer (ids and prompts, hints included), the imitation buffer's
    ids and the step's counts."""
    content = json.dumps({"rl": [(r["example_id"], r["prompt"]) for r in rl],
                          "imitation": [r["example_id"] for r in imitation], "counts": counts}, sort_keys=True)
    return hashlib.sha1(content.encode()).hexdigest()[:12]


def digests_by_rank(digest: str, step: int) -> list[str]:
    """Every rank's routing digest of ``step``, gathered; a disagreement stops the run (the ranks would train on
    different buffers)."""
    state = process_state()
    if state.num_processes == 1:
        return [digest]
    gathered: list[Any] = [None] * state.num_processes
    dist.all_gather_object(gathered, digest)
    if len(set(gathered)) > 1:
        raise RuntimeError(f"the ranks routed step {step} differently (routing digests by rank: {gathered})")
    return gathered


def _inner(optimizer) -> Any:
    """The optimizer under accelerate's wrapper: torch's AdamW, or DeepSpeed's ZeRO optimizer around it."""
    return getattr(optimizer, "optimizer", optimizer)


def load_optimizer_state(optimizer, saved: dict) -> None:
    """Load Adam's moments from ``saved`` into a new update's optimizer, keeping its learning rate (the new update's
    scheduler set it; the saved one is where the last update's schedule ended). Under ZeRO the master weights are
    refreshed from the current weights, which another update may have moved since the state was taken: ZeRO-1/2 by
    ``load_from_fp32_weights=False``; ZeRO-3's loader always restores them from the state it is given, so it is given
    the new engine's own (made from the current weights)."""
    inner = _inner(optimizer)
    rates = [{key: group[key] for key in ("lr", "initial_lr") if key in group} for group in inner.param_groups]
    if type(inner).__module__.startswith("deepspeed."):
        if hasattr(inner, "fp32_partitioned_groups_flat"):  # ZeRO-3
            saved = {**saved, FP32_FLAT_GROUPS: [t.detach().clone() for t in inner.fp32_partitioned_groups_flat]}
        inner.load_state_dict([saved] * process_state().num_processes, load_optimizer_states=True,
                              load_from_fp32_weights=False)
    else:
        inner.load_state_dict(saved)
    for group, rate in zip(inner.param_groups, rates, strict=True):
        group.update(rate)


class CarryOptimizerState(TrainerCallback):
    """Carries an update kind's optimizer state (``states[name]``) from one Trainer to the next."""

    def __init__(self, states: dict[str, dict], name: str):
        self.states, self.name = states, name

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.states.get(self.name) is not None:
            load_optimizer_state(optimizer, self.states[self.name])

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        self.states[self.name] = _inner(optimizer).state_dict()


def retire(trainer) -> None:
    """Let go of an update's Trainer before the next is built around the same model: a DeepSpeed engine's gradient
    hooks are removed (a second engine would otherwise reduce every gradient twice), and under ZeRO-3 the backward
    functions it left on every module (``pre_bwd_fn``, ``post_bwd_fn``: its ``destroy`` keeps them, and the next
    engine reuses rather than replaces them, so its backward would fetch parameters through the destroyed engine's
    coordinator; seen as empty parameters in the SFT injection's recomputed activations); the old DDP wrapper or
    engine is collected now rather than whenever the cycle collector runs."""
    if trainer is None:
        return
    engine = trainer.model_wrapped
    if hasattr(engine, "destroy") and engine is not trainer.model:
        engine.destroy()
        for module in trainer.model.modules():
            for name in ZERO3_MODULE_FUNCTIONS:
                module.__dict__.pop(name, None)
    gc.collect()


@contextmanager
def generation_model(model, trainer) -> Iterator[Any]:
    """The policy to generate with: the model under the last update's wrapper (DDP, a DeepSpeed engine), unwrapped
    by TRL's ``unwrap_model_for_generation`` as its trainers do for their own rollouts."""
    if trainer is None:
        yield model
        return
    from trl.models.utils import unwrap_model_for_generation

    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator,
                                     gather_deepspeed3_params=True) as unwrapped:
        yield unwrapped


@contextmanager
def gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """``params`` whole on every rank for the block, to be read: ZeRO-3's partitioned parameters gathered by
    DeepSpeed's ``GatheredParameters`` (and partitioned again after it), any other parameter as it is."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed  # only a ZeRO-3 launch reaches here: deepspeed is an optional dependency

    with deepspeed.zero.GatheredParameters(params):
        yield


def adapter_digest(adapter: dict[str, torch.Tensor]) -> str:
    """A short digest of an adapter's weights by name (as PEFT saves them), the same for a saved adapter and for the
    weights a rank holds.

    >>> one, two = {"b": torch.ones(2), "a": torch.zeros(1)}, {"a": torch.zeros(1), "b": torch.ones(2)}
    >>> adapter_digest(one) == adapter_digest(two) != adapter_digest({**one, "a": torch.ones(1)})
    True
    """
    digest = hashlib.sha1()
    for name in sorted(adapter):
        digest.update(name.encode())
        digest.update(adapter[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def adapter_by_rank(model, trainable: list[torch.nn.Parameter]) -> list[str]:
    """Every rank's digest of the adapter it holds (gathered under ZeRO-3), gathered, for the step log: all equal, and
    equal to the saved adapter's digest."""
    with gathered(trainable):
        digest = adapter_digest(get_peft_model_state_dict(model))
    state = process_state()
    if state.num_processes == 1:
        return [digest]
    digests: list[Any] = [None] * state.num_processes
    dist.all_gather_object(digests, digest)
    return digests


def state_file(kind: str, rank: int) -> str:
    """One rank's file of an optimizer state (``grpo``, ``sft``) or of its RNG (``rng``)."""
    return f"{kind}_rank{rank}.pt"


def save_rank_state(folder: Path, states: dict[str, dict]) -> None:
    """This rank's optimizer states (those made so far) and RNG state, into ``folder``."""
    rank = process_state().process_index
    for kind, saved in states.items():
        if saved is not None:
            torch.save(saved, folder / state_file(f"{kind}_optimizer", rank))
    torch.save(torch.get_rng_state(), folder / state_file("rng", rank))


def load_rank_state(folder: Path, kinds: tuple[str, ...]) -> dict[str, dict | None]:
    """What ``save_rank_state`` wrote for this rank (None for a kind that had not run); restores the RNG."""
    rank = process_state().process_index
    torch.set_rng_state(torch.load(folder / state_file("rng", rank)))
    paths = {kind: folder / state_file(f"{kind}_optimizer", rank) for kind in kinds}
    # our own files: ZeRO's state holds DeepSpeed objects (its loss scaler), which weights_only would refuse
    return {kind: torch.load(path, weights_only=False) if path.exists() else None for kind, path in paths.items()}


def save_weights(model, tokenizer, trainer, folder: Path) -> None:
    """Every rank calls this: the adapter through the last update's Trainer (its ``save_model``, which under DeepSpeed
    takes every rank), or, before any update, the model the main process holds; the tokenizer beside it."""
    state = process_state()
    if trainer is not None:
        trainer.save_model(str(folder))
    elif state.is_main_process:
        model.save_pretrained(folder)
    if state.is_main_process:
        tokenizer.save_pretrained(folder)
    state.wait_for_everyone()
