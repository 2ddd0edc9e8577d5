"""serving/stack_metrics.py: one Prometheus page for a stack, and the token totals read off it by the roles each
counter stands for (the front door's page itself is tested in test_front_door.py)."""

from __future__ import annotations

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from overstory.serving.stack_metrics import ROLE_INFO, merge_pages, role_groups, token_totals

VLLM_PAGE = ("# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
             "# TYPE vllm:prompt_tokens_total counter\n"
             'vllm:prompt_tokens_total{model_name="generator"} 40.0\n'
             "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
             "# TYPE vllm:generation_tokens_total counter\n"
             'vllm:generation_tokens_total{model_name="generator"} 9.0\n')
OWN_PAGE = ("# HELP overstory:prompt_tokens_total Prompt (input) tokens processed.\n"
            "# TYPE overstory:prompt_tokens_total counter\n"
            'overstory:prompt_tokens_total{model_name="embedder"} 3.0\n'
            'overstory:prompt_tokens_total{model_name="scorer"} 5.0\n')


def test_a_servers_page_read_directly_counts_all_its_roles_together() -> None:
    """A stack.json's servers read one by one: vLLM's page names only its first served name, so its counters stand
    for every role of that URL; the embedded server's single role keeps its own name."""
    totals = token_totals({"http://v": VLLM_PAGE, "http://e": OWN_PAGE},
                          {"http://v": ["generator", "planner"], "http://e": ["embedder", "scorer"]})
    assert totals == {"generator+planner": {"prompt_tokens": 40, "completion_tokens": 9},
                      "embedder+scorer": {"prompt_tokens": 8, "completion_tokens": 0}}
    lora = token_totals({"http://v": VLLM_PAGE.replace("generator", "planner-base")}, {"http://v": ["planner"]})
    assert set(lora) == {"planner"}  # a LoRA role alone on its server: vLLM counts it under the base model's name
    alone = token_totals({"http://e": OWN_PAGE})  # one URL for everything: the embedded server counts by role
    assert alone == {"embedder": {"prompt_tokens": 3, "completion_tokens": 0},
                     "scorer": {"prompt_tokens": 5, "completion_tokens": 0}}


def test_the_merged_page_keeps_every_sample_and_reads_back_by_role() -> None:
    registry = merge_pages(OWN_PAGE, {"http://v1": VLLM_PAGE, "http://v2": VLLM_PAGE},
                           {"http://v1": ["generator", "planner"], "http://v2": ["judge"]})
    page = generate_latest(registry).decode()
    samples = [s for family in text_string_to_metric_families(page) for s in family.samples]
    assert len([s for s in samples if s.name == "vllm:prompt_tokens_total"]) == 2  # one per server, kept apart
    assert {s.labels["role"] for s in samples if s.name == ROLE_INFO} == {"generator", "planner", "judge"}
    assert token_totals({"http://front": page}) == {
        "generator+planner": {"prompt_tokens": 40, "completion_tokens": 9},
        "judge": {"prompt_tokens": 40, "completion_tokens": 9},
        "embedder": {"prompt_tokens": 3, "completion_tokens": 0},
        "scorer": {"prompt_tokens": 5, "completion_tokens": 0}}


def test_a_stack_json_that_lists_the_door_and_its_server_counts_each_once() -> None:
    """The front door's page repeats the vLLM server's samples; read beside that server's own page (a stack.json's
    roles point at both), they are counted once."""
    door = generate_latest(merge_pages(OWN_PAGE, {"http://v": VLLM_PAGE}, {"http://v": ["generator", "planner"]}))
    totals = token_totals({"http://v": VLLM_PAGE, "http://front": door.decode()},
                          {"http://v": ["generator", "planner"], "http://front": ["embedder"]})
    assert totals["generator+planner"] == {"prompt_tokens": 40, "completion_tokens": 9}


def test_a_family_two_pages_type_differently_is_named() -> None:
    gauge = "# TYPE vllm:prompt_tokens gauge\nvllm:prompt_tokens 1.0\n"  # another version's gauge of that name
    with pytest.raises(ValueError, match="http://odd exports vllm:prompt_tokens as a gauge, another server as a"):
        merge_pages("", {"http://v": VLLM_PAGE, "http://odd": gauge}, {})


def test_a_role_no_counter_stands_for_is_compared_by_its_own_name() -> None:
    """The harness's sums grouped as the servers count them; a role the servers never counted stays apart, so the
    cost check fails on it instead of hiding it in a group."""
    ours = {"generator": {"prompt_tokens": 30, "completion_tokens": 5, "calls": 2},
            "planner": {"prompt_tokens": 10, "completion_tokens": 4, "calls": 1},
            "judge": {"prompt_tokens": 7, "completion_tokens": 1, "calls": 1}}
    assert role_groups(ours, ["generator+planner", "embedder"]) == {
        "generator+planner": {"prompt_tokens": 40, "completion_tokens": 9},
        "judge": {"prompt_tokens": 7, "completion_tokens": 1}}
