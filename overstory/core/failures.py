"""The failure share: a job that works item by item (a data job's chunks, an evaluation's questions) fails as a whole
when more than ``max_failure_share`` of the items it attempted failed. ``TooManyFailures`` says so with the job's
counters; ``overstory`` turns it into exit code 1. It lives in the ground layer so that any job may raise it.
"""

from __future__ import annotations

from collections.abc import Mapping

from overstory.core.config import ConfigError


class TooManyFailures(RuntimeError):
    """More than the job's ``max_failure_share`` of the items it attempted failed; ``counts`` are the job's
    counters (the outputs written so far are kept, and a rerun retries the failed items)."""

    def __init__(self, message: str, counts: Mapping[str, int]):
        super().__init__(message)
        self.counts = dict(counts)


def check_failure_share(max_failure_share: float) -> None:
    """ConfigError naming ``max_failure_share`` unless it is a share (0 to 1).

    >>> check_failure_share(0.05)
    >>> check_failure_share(5)
    Traceback (most recent call last):
    ...
    overstory.core.config.ConfigError: max_failure_share must be between 0 and 1, got 5
    """
    if not 0.0 <= max_failure_share <= 1.0:
        raise ConfigError(f"max_failure_share must be between 0 and 1, got {max_failure_share}")


def too_many_failures(failed: int, attempted: int, max_failure_share: float) -> bool:
    """Whether ``failed`` of ``attempted`` items is more than the share allows (any failure, at share 0).

    >>> too_many_failures(1, 4, 0.25), too_many_failures(2, 4, 0.25), too_many_failures(1, 100, 0.0)
    (False, True, True)
    """
    return failed > 0 and failed > max_failure_share * attempted


def raise_if_too_many(job: str, counts: Mapping[str, int], attempted: int, max_failure_share: float,
                      where: str = "") -> None:
    """``TooManyFailures`` when ``counts["failed"]`` of the ``attempted`` items is more than ``max_failure_share``;
    ``where`` says where the failed items are listed (the message says a rerun retries them)."""
    failed = counts.get("failed", 0)
    if too_many_failures(failed, attempted, max_failure_share):
        listed = f"they are listed in {where} and " if where else ""
        raise TooManyFailures(f"{job}: {failed} of {attempted} items failed (max_failure_share "
                              f"{max_failure_share:g}; {listed}a rerun retries them)", counts)
