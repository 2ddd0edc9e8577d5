"""Reading a server's Prometheus ``/metrics`` page in tests: every sample by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """The page's samples: (sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float | None:
    """The sample ``name`` with exactly ``labels`` (None when the page has none)."""
    return samples.get((name, tuple(sorted(labels.items()))))
