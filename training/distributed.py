"""How the training recipes join a process group, whatever launched them.

accelerate picks a collective backend only for accelerator devices (NCCL on CUDA). Launched by
``accelerate launch`` with a DeepSpeed config on a machine without CUDA, it therefore leaves every
process believing it is alone (world size 1) while DeepSpeed itself sees all of them, and the two
disagree on the global batch size. Naming gloo explicitly when the job is distributed and CUDA is
absent makes accelerate, the Hugging Face Trainer and DeepSpeed share one gloo group, which is how
ZeRO runs on CPU (CI, laptops). On GPU nodes this returns None and the launchers' NCCL default stands.
"""

from __future__ import annotations

import os

import torch
from accelerate import InitProcessGroupKwargs


def launched_distributed() -> bool:
    """True under torchrun / accelerate launch / deepspeed (they all export LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", -1)) != -1


def world_size() -> int:
    """How many processes the launcher started (1 when run directly)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def cpu_ddp() -> bool:
    """True for a launch of several processes without CUDA and without DeepSpeed: DDP over gloo on CPUs. accelerate
    calls that MULTI_CPU only when told ``cpu``; otherwise each rank believes it trains alone (no gradient sync,
    every rank on the whole data), which looks like a one-process run."""
    return (launched_distributed() and not torch.cuda.is_available()
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false") != "true")


def trainer_device_args() -> dict[str, bool]:
    """A Trainer's ``use_cpu`` under DDP on CPUs: its arguments set up the process state again, and without it
    accelerate would take the ranks for independent processes (no gradient sync, no gather)."""
    return {"use_cpu": True} if cpu_ddp() else {}


def process_group_backend() -> str | None:
    """``"gloo"`` for a distributed job on a machine without CUDA, otherwise None (the default)."""
    if launched_distributed() and not torch.cuda.is_available():
        return "gloo"
    return None


def accelerator_handlers() -> list[InitProcessGroupKwargs]:
    """``kwargs_handlers`` for ``Accelerator``: gloo when :func:`process_group_backend` asks for it."""
    backend = process_group_backend()
    return [InitProcessGroupKwargs(backend=backend)] if backend else []
