"""A stack's Prometheus counters on one page, and the token totals a client reads off them.

An ``engine: vllm`` stack is several servers: the embedded one (MiniLM, a cross-encoder) and one vLLM server per
model. The front door answers ``GET /metrics`` for all of them (``merge_pages``): the embedded server's own samples
as they are, every vLLM server's with a ``server`` label naming it (two vLLM servers both export
``vllm:prompt_tokens_total`` and ``process_cpu_seconds_total``; the label keeps their samples apart, as
Prometheus federation's ``instance`` does), and one ``overstory:upstream_role_info{server, role}`` sample per role
a vLLM server answers for. One scrape target then covers the stack, and a client behind the front door sees vLLM's
token counters, which it could not reach otherwise.

vLLM counts a server's tokens under its first served model name: roles served under further names or as LoRA
modules are not told apart there. ``token_totals`` therefore keys each counter by the roles it can stand for:
the role itself where the server counts by role (the embedded server), else every role of that server joined by
``+`` (``generator+planner+scorer``). A client that compares its own per-role sums against these (the evaluation
harness's cost check) sums its roles the same way (``role_groups``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

SERVER_LABEL = "server"
ROLE_INFO = "overstory:upstream_role_info"
ROLE_JOIN = "+"
# the token counters of both servers: vLLM's vllm:prompt_tokens_total and the embedded overstory:prompt_tokens_total
_TOKEN_SAMPLES = {"prompt_tokens_total": "prompt_tokens", "generation_tokens_total": "completion_tokens"}


class _Families:
    """A collector that yields families already read (prometheus_client renders them like its own)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_pages(own_page: str, upstream_pages: Mapping[str, str],
                roles: Mapping[str, Sequence[str]]) -> CollectorRegistry:
    """One registry holding ``own_page``'s families and each upstream's (``upstream_pages``: server URL -> its
    Prometheus text page), upstream samples labelled ``server=<URL>``, plus ``ROLE_INFO`` from ``roles`` (server
    URL -> the roles it answers for). Render it with prometheus_client's encoders. A family name that two pages
    give different types cannot be one family: ValueError naming it."""
    merged: dict[str, Metric] = {}

    def add(families: Iterable[Metric], extra: dict[str, str], source: str) -> None:
        for family in families:
            target = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                           family.unit))
            if target.type != family.type:
                raise ValueError(f"{source} exports {family.name} as a {family.type}, another server as a "
                                 f"{target.type}: the pages cannot be merged")
            target.samples.extend(sample._replace(labels={**sample.labels, **extra}) for sample in family.samples)

    add(text_string_to_metric_families(own_page), {}, "the embedded server")
    for url, page in upstream_pages.items():
        add(text_string_to_metric_families(page), {SERVER_LABEL: url}, url)
    info = GaugeMetricFamily(ROLE_INFO, "The roles each server behind the front door answers for (value 1).",
                             labels=[SERVER_LABEL, "role"])
    for url, served in roles.items():
        for role in served:
            info.add_metric([url, role], 1)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families([*merged.values(), info]))
    return registry


def token_totals(pages: Mapping[str, str], roles_by_server: Mapping[str, Sequence[str]] | None = None
                 ) -> dict[str, dict[str, int]]:
    """Prompt and generated tokens counted on ``pages`` (URL -> Prometheus text page), keyed by the roles each
    counter stands for (module docstring): a sample with a ``server`` label (a front door's page) by the roles
    its ``ROLE_INFO`` names, unless that server's own page is among ``pages`` (a stack.json lists the front door and
    the vLLM servers: each is counted once, from its own page); a page whose URL's roles are known
    (``roles_by_server``, a stack.json's servers read one by one) by all of them (a LoRA role served alone is counted
    under its base model's name); else by its ``model_name`` label, the role.

    >>> page = ('vllm:prompt_tokens_total{model_name="generator",server="http://v"} 7\\n'
    ...         'overstory:prompt_tokens_total{model_name="embedder"} 3\\n'
    ...         'overstory:upstream_role_info{server="http://v",role="generator"} 1\\n'
    ...         'overstory:upstream_role_info{server="http://v",role="planner"} 1\\n')
    >>> token_totals({"http://front": page})
    {'generator+planner': {'prompt_tokens': 7, 'completion_tokens': 0}, \
'embedder': {'prompt_tokens': 3, 'completion_tokens': 0}}
    """
    samples = list(own_samples(pages))
    upstream_roles: dict[str, list[str]] = {}
    for _, sample in samples:
        if sample.name == ROLE_INFO:
            upstream_roles.setdefault(sample.labels[SERVER_LABEL], []).append(sample.labels["role"])
    totals: dict[str, dict[str, int]] = {}
    for url, sample in samples:
        kind = _TOKEN_SAMPLES.get(sample.name.split(":", 1)[-1])
        if kind is None:
            continue
        page_roles = (roles_by_server or {}).get(url, ())
        if (server := sample.labels.get(SERVER_LABEL)) in upstream_roles:
            key = ROLE_JOIN.join(sorted(upstream_roles[server]))
        elif page_roles:
            key = ROLE_JOIN.join(sorted(page_roles))
        else:
            key = sample.labels.get("model_name", "")
        row = totals.setdefault(key, {"prompt_tokens": 0, "completion_tokens": 0})
        row[kind] += int(sample.value)
    return totals


def own_samples(pages: Mapping[str, str]) -> Iterator[tuple[str, Sample]]:
    """Every sample on ``pages`` (URL -> Prometheus text page) with the URL it was read from, less the front door's
    copies of a server whose own page is among ``pages`` (a stack.json lists the door and its vLLM servers): each
    server's samples once."""
    for url, page in pages.items():
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.labels.get(SERVER_LABEL) not in pages:
                    yield url, sample


def role_groups(per_role: Mapping[str, Mapping[str, int]], keys: Iterable[str]) -> dict[str, dict[str, int]]:
    """``per_role``'s prompt and completion tokens summed under the ``token_totals`` key that covers each role
    (its own name where no key covers it), so the two can be compared.

    >>> role_groups({"planner": {"prompt_tokens": 4, "completion_tokens": 1},
    ...              "generator": {"prompt_tokens": 3, "completion_tokens": 2}}, ["generator+planner"])
    {'generator+planner': {'prompt_tokens': 7, 'completion_tokens': 3}}
    """
    covering = {role: key for key in keys for role in key.split(ROLE_JOIN)}
    grouped: dict[str, dict[str, int]] = {}
    for role, counts in per_role.items():
        row = grouped.setdefault(covering.get(role, role), {"prompt_tokens": 0, "completion_tokens": 0})
        for kind in row:
            row[kind] += counts.get(kind, 0)
    return grouped
