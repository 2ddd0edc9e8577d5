"""One thread per served encoder model: its forward passes run there, one at a time.

The server runs request handlers on anyio's worker threads, a pool that grows under load and retires idle
threads. glibc gives each thread a malloc arena of its own, so tensors allocated by whichever handler ran a
forward pass spread over many arenas, which fragment: measured on the embedded server (issue 12), rounds of 200
rerank requests at concurrency 32 raised its resident memory by 57, 37, 17, 14, 11 ... MiB per round while Python's
own heap grew by 0.5 MiB over 1,200 requests (tracemalloc). Running every forward pass of a model on one thread
keeps its allocations in one arena, and serialises them, as the lock it replaces did (torch already uses every
core for one batch). The chat models have their own worker thread already (``batching.Batcher``).

The handler threads still allocate (requests, tokenisation, JSON), so the serving process also caps glibc's arenas
(``limit_malloc_arenas``, ``ServeConfig.malloc_arena_max``): with that at 2 the 1,000-request mixed load of
docs/results.md (Serving) grew 94 MiB from its first to its last quarter (66 MiB with ``MALLOC_ARENA_MAX=2`` set
before the process started), against 123 MiB with glibc's default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

    def close(self) -> None:
        """Finish what was submitted and end the thread."""
        self._pool.shutdown(wait=True)


_M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)


def limit_malloc_arenas(count: int) -> bool:
    """Cap glibc's malloc arenas at ``count`` (``mallopt(M_ARENA_MAX, count)``; the ``MALLOC_ARENA_MAX``
    environment variable does the same at process start). Returns whether it applied: False where the C library
    is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, count))
    except (OSError, AttributeError):  # no libc found, or one without mallopt (musl, macOS)
        return False
