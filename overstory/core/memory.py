"""Resident memory of process trees, sampled in the background while a benchmark runs (psutil)."""

from __future__ import annotations

import threading

import psutil


class MemorySampler:
    """Resident memory (MiB) of a set of processes and their children, sampled every ``every_s`` seconds."""

    def __init__(self, pids: list[int], every_s: float = 0.5):
        self.processes = [psutil.Process(pid) for pid in pids]
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def rss_mib(self) -> float:
        total = 0
        for process in self.processes:
            for p in [process, *process.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        return total / 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.rss_mib())
            self._stop.wait(self.every_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
