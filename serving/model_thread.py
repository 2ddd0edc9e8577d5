"""One thread per served encoder model: its forward passes run there, one at a time.

The server runs request handlers on anyio's worker threads, a pool that grows under load and retires idle
threads. glibc gives each thread a malloc arena of its own, so tensors allocated by whichever handler ran a
forward pass spread over many arenas, which fragment: measured on the embedded server (issue 12), rounds of 200
rerank requests at concurrency 32 raised its resident memory by 57, 37, 17, 14, 11 ... MiB per round while Python's
own heap grew by 0.5 MiB over 1,200 requests (tracemalloc). Running every forward pass of a model on one thread
keeps its allocations in one arena, and serialises them, as the lock it replaces did (torch already uses every
core for one batch). The chat models have their own worker thread already (``batching.Batcher``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ModelThread:
    """Runs callables on a single thread of its own and returns their results (or raises their errors)."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{name}")

    def run(self, fn: Callable[[], T]) -> T:
        return self._pool.submit(fn).result()
