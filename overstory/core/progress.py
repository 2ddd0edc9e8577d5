"""Progress of a long job: rich's bar on a terminal, and plain lines where the output goes to a file.

rich draws its bar only on a terminal. A job running in the background with its output in a log (the teacher
runbook's ``runs/teacher/logs/<job>.log``, a cluster's job log) would show nothing until its end, which for the
teacher's jobs is an hour or more. :class:`JobProgress` is rich's ``Progress`` with the same calls; where its
console is not a terminal it also prints one line per task every ``interval_s`` seconds and when the task ends::

    summarising: 120/1664 (7%), 0:04:02 elapsed, about 0:52:10 left

The estimate of what is left is the task's average pace so far: the teacher's jobs finish items in bursts (eight in
flight end together), which rich's own estimate, the speed over its last 30 seconds, turns into minutes one line and
hours the next.
:func:`track` is rich's ``track`` through it, for loops over a sequence.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from rich.progress import Progress, Task, TaskID

T = TypeVar("T")


def clock(seconds: float | None) -> str:
    """``seconds`` as H:MM:SS (``?`` when unknown, as before the first item ends)."""
    return "?" if seconds is None else str(timedelta(seconds=round(seconds)))


class JobProgress(Progress):
    """rich's ``Progress``; on a console that is not a terminal (and not disabled), plain progress lines too."""

    def __init__(self, *columns: Any, interval_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self.interval_s = interval_s
        self.lines = not self.disable and not self.console.is_terminal
        self.last_line: dict[TaskID, float] = {}  # when each task's last line was printed (or the task added)
        self.ended: set[TaskID] = set()  # the tasks whose last line is printed

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self.last_line[task_id] = self.get_time()
        return task_id

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self.report(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self.report(task_id)

    def report(self, task_id: TaskID) -> None:
        """Print the task's line when ``interval_s`` has passed since its last one, or once when it ends. Under
        rich's own lock: jobs advance their task from worker threads, and two of them must not print the same line."""
        if not self.lines:
            return
        with self._lock:
            task = self._tasks[task_id]
            now = self.get_time()
            if task_id in self.ended or (not task.finished and now - self.last_line[task_id] < self.interval_s):
                return
            self.last_line[task_id] = now
            if task.finished:
                self.ended.add(task_id)
            total = f"/{task.total:g} ({task.percentage:.0f}%)" if task.total else ""
            left = "done" if task.finished else f"about {clock(remaining(task))} left"
            self.console.print(f"{task.description}: {task.completed:g}{total}, {clock(task.elapsed)} elapsed, "
                               f"{left}", markup=False, highlight=False, soft_wrap=True)


def remaining(task: Task) -> float | None:
    """The seconds ``task`` still needs at its average pace so far (None before its first item, or without a total)."""
    if not task.total or not task.completed or not task.elapsed:
        return None
    return (task.total - task.completed) * task.elapsed / task.completed


def track(sequence: Iterable[T], description: str, total: float | None = None) -> Iterator[T]:
    """rich's ``track`` through :class:`JobProgress`: each item of ``sequence`` as it comes, the bar on a terminal and
    a line a minute in a log."""
    with JobProgress() as progress:
        yield from progress.track(sequence, total=total, description=description)
