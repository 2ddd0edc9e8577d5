"""JobProgress (overstory/core/progress.py): plain progress lines where the output is a file, rich's bar alone on a
terminal, nothing when disabled."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from overstory.core.progress import JobProgress, clock, track


class Clock:
    """A clock the test moves by hand, so the lines' timing does not depend on how fast the test runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress_to(file: io.StringIO, terminal: bool, now: Clock, **kwargs) -> JobProgress:
    console = Console(file=file, force_terminal=terminal, width=60)
    return JobProgress(console=console, get_time=now, interval_s=60, auto_refresh=False, **kwargs)


def test_a_log_gets_a_line_a_minute_and_one_at_the_end() -> None:
    out, now = io.StringIO(), Clock()
    with progress_to(out, terminal=False, now=now) as progress:
        task = progress.add_task("summarising", total=100)
        for _ in range(10):  # 10 items in 50 s: no minute has passed, no line yet
            now.now += 5
            progress.advance(task)
        assert out.getvalue() == ""
        for _ in range(10):  # the minute passes at the 12th item: one line, what is left at the pace so far (5 s)
            now.now += 5
            progress.advance(task)
        lines = out.getvalue().splitlines()
        assert lines == ["summarising: 12/100 (12%), 0:01:00 elapsed, about 0:07:20 left"]
        progress.update(task, advance=80)  # update() reports too: the task ends, its last line says so
        progress.advance(task, 0)  # and a later call prints nothing more
    lines = [line for line in out.getvalue().splitlines() if line.startswith("summarising:")]
    assert len(lines) == 2 and lines[1] == "summarising: 100/100 (100%), 0:01:40 elapsed, done"


def test_a_long_description_stays_on_one_line_and_brackets_are_not_markup() -> None:
    out, now = io.StringIO(), Clock()
    with progress_to(out, terminal=False, now=now) as progress:
        task = progress.add_task("[bold]answering " + "x" * 80, total=1)
        progress.advance(task)
    assert "[bold]answering " + "x" * 80 + ": 1/1 (100%)" in out.getvalue().splitlines()[0]


def test_a_terminal_gets_the_bar_only_and_a_disabled_progress_nothing() -> None:
    for terminal, disable in ((True, False), (False, True)):
        out, now = io.StringIO(), Clock()
        with progress_to(out, terminal=terminal, now=now, disable=disable) as progress:
            task = progress.add_task("summarising", total=2)
            now.now += 120
            progress.advance(task)
            progress.advance(task)
        assert "summarising:" not in out.getvalue()
        assert ("━" in out.getvalue()) == terminal


def test_clock() -> None:
    assert (clock(None), clock(59.6), clock(3725)) == ("?", "0:01:00", "1:02:05")


def test_track_yields_every_item_in_order_and_ends_with_a_line(capsys) -> None:
    """track() through JobProgress: under pytest's captured output (not a terminal) the last line says done."""
    assert list(track(iter(range(5)), "building hierarchies", total=5)) == [0, 1, 2, 3, 4]
    assert "building hierarchies: 5/5 (100%), " in capsys.readouterr().out


def test_workers_advancing_at_once_print_each_line_once() -> None:
    """Jobs advance from worker threads (eval compressor's summaries): the minute's line and the last one, once each."""
    out, now = io.StringIO(), Clock()
    with progress_to(out, terminal=False, now=now) as progress:
        task = progress.add_task("summarising", total=400)
        now.now += 120  # every advance is past the interval; only the first of them may print the minute's line

        def work() -> None:
            for _ in range(50):
                progress.advance(task)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    lines = [line for line in out.getvalue().splitlines() if line.startswith("summarising:")]
    # the first line comes with the first advances (another worker may have advanced before it printed)
    assert len(lines) == 2 and "left" in lines[0] and lines[1].startswith("summarising: 400/400 (100%)")
    assert lines[1].endswith("elapsed, done")
