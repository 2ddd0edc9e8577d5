"""vLLM launch specs: server grouping, LoRA modules, command lines and the errors raised before any launch.

vLLM itself is not installed in this environment; these tests check what overstory decides and builds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overstory.core.config import ConfigError
from overstory.serving import vllm
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import free_port, run_vllm_stack
from overstory.serving.vllm import ServerDied, VllmNotInstalled, plan_servers, start_server, vllm_command

BASE = "Qwen/Qwen2.5-1.5B-Instruct"


def _adapter(folder: Path, base: str = BASE, rank: int = 16) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "r": rank}))
    (folder / "overstory.json").write_text(json.dumps({"kind": "planner", "base_model": base}))
    return str(folder)


def test_roles_on_one_port_share_a_server_with_lora_modules(tmp_path: Path) -> None:
    planner = _adapter(tmp_path / "planner")
    scorer = _adapter(tmp_path / "scorer", rank=32)
    config = ServeConfig(engine="vllm", port=8000, roles={
        "generator": RoleConfig(model="Qwen/Qwen2.5-7B-Instruct", tensor_parallel_size=2, dtype="bfloat16"),
        "planner": RoleConfig(model=BASE, adapter=planner, port=8010, dtype="bfloat16"),
        "scorer": RoleConfig(model=BASE, adapter=scorer, port=8010, dtype="bfloat16"),
        "embedder": RoleConfig(model="builtin:all-minilm-l6-v2", kind="embedding")})
    servers, rest = plan_servers(config, available_gpus=8)
    assert [s.port for s in servers] == [8001, 8010]  # the generator gets the first free port after `port`
    generator, shared = servers
    assert generator.served_names == ["generator"] and generator.tensor_parallel_size == 2
    assert shared.lora_modules == {"planner": planner, "scorer": scorer} and shared.served_names == []
    assert rest is not None and list(rest.roles) == ["embedder"] and rest.port == 8000

    command = vllm_command(shared, "0.0.0.0", ["--enforce-eager"], python="/opt/vllm/bin/python")
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(command)
    assert f"--model {BASE}" in text and "--port 8010" in text and "--dtype bfloat16" in text
    assert f"--lora-modules planner={planner} scorer={scorer}" in text and "--max-lora-rank 32" in text
    assert "--served-model-name planner-base" in text and command[-1] == "--enforce-eager"
    assert "--served-model-name generator" in " ".join(vllm_command(generator, "0.0.0.0"))


@pytest.mark.parametrize(("roles", "error"), [
    ({"generator": RoleConfig(model="a", port=9001), "planner": RoleConfig(model="b", port=9001)},
     "share port 9001 but name different models"),
    ({"generator": RoleConfig(model="a", port=8000)}, "is the embedded server's port"),
    ({"generator": RoleConfig(model="a", tensor_parallel_size=4), "scorer": RoleConfig(model="b",
                                                                                        tensor_parallel_size=8)},
     "ask for 12 GPUs"),
])
def test_bad_stacks_fail_before_launch(roles: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        plan_servers(ServeConfig(engine="vllm", port=8000, roles=roles), available_gpus=8)


def test_adapter_from_another_base_model_is_refused(tmp_path: Path) -> None:
    adapter = _adapter(tmp_path / "planner", base="builtin:smollm2-135m-instruct")
    config = ServeConfig(engine="vllm", roles={"planner": RoleConfig(model=BASE, adapter=adapter)})
    with pytest.raises(ConfigError, match="was trained on builtin:smollm2-135m-instruct"):
        plan_servers(config)


def test_missing_vllm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OVERSTORY_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(vllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(VllmNotInstalled, match="pip install -e .\\[vllm\\]"):
        run_vllm_stack(ServeConfig(engine="vllm", roles={"generator": RoleConfig(model=BASE)}))
    with pytest.raises(VllmNotInstalled, match="does not exist"):
        run_vllm_stack(ServeConfig(engine="vllm", vllm_python=str(tmp_path / "nope" / "python"),
                                   roles={"generator": RoleConfig(model=BASE)}))
    # an interpreter that exists but has no vLLM: the main one, asked through the subprocess probe
    monkeypatch.setenv("OVERSTORY_VLLM_PYTHON", str(tmp_path / "python"))
    (tmp_path / "python").symlink_to(sys.executable)
    with pytest.raises(VllmNotInstalled, match="cannot import vLLM"):
        run_vllm_stack(ServeConfig(engine="vllm", roles={"generator": RoleConfig(model=BASE)}))


def test_commands_run_the_configured_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    server = plan_servers(ServeConfig(engine="vllm", port=8000, roles={"generator": RoleConfig(model=BASE)}))[0][0]
    monkeypatch.setenv("OVERSTORY_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert vllm_command(server, "127.0.0.1")[0] == "/opt/vllm/bin/python"
    assert vllm_command(server, "127.0.0.1", python="/elsewhere/python")[0] == "/elsewhere/python"
    monkeypatch.delenv("OVERSTORY_VLLM_PYTHON")
    assert vllm_command(server, "127.0.0.1")[0] == sys.executable


def test_a_server_that_dies_during_start_up_shows_its_log_tail(tmp_path: Path) -> None:
    # a stand-in process (not vLLM): prints an error the way a failing model load does, then exits
    command = [sys.executable, "-c", "import sys; print('loading weights'); print('CUDA out of memory'); sys.exit(3)"]
    with pytest.raises(ServerDied, match="(?s)exited with code 3.*CUDA out of memory"):
        start_server(command, "http://127.0.0.1:9", tmp_path / "vllm.log", timeout_s=30, poll_s=0.05)


def test_a_background_stack_shares_one_server_per_base_model_on_free_ports() -> None:
    config = ServeConfig(engine="vllm", port=0, roles={
        "generator": RoleConfig(model=BASE), "planner": RoleConfig(model=BASE), "scorer": RoleConfig(model="other"),
        "embedder": RoleConfig(model="builtin:all-minilm-l6-v2", kind="embedding")})
    servers, rest = plan_servers(config)
    assert [s.served_names for s in servers] == [["generator", "planner"], ["scorer"]]
    assert all(s.port > 0 for s in servers) and servers[0].port != servers[1].port
    assert rest is not None and rest.port == 0


def test_a_launched_server_stops_when_the_job_that_started_it_dies(tmp_path: Path) -> None:
    # a stand-in server (not vLLM: it answers /health the way vLLM does); the job is killed with SIGKILL,
    # so no cleanup code of the job runs, and Linux's parent-death signal must stop the server
    port = free_port()
    server = (f"import http.server as h\nclass H(h.BaseHTTPRequestHandler):\n def do_GET(self):\n"
              f"  self.send_response(200); self.end_headers()\nh.HTTPServer(('127.0.0.1', {port}), H).serve_forever()")
    job = (f"import os, signal, sys\nfrom pathlib import Path\nfrom serving.vllm import start_server\n"
           f"p = start_server([sys.executable, '-c', {server!r}], 'http://127.0.0.1:{port}', "
           f"Path({str(tmp_path / 'server.log')!r}), timeout_s=60, poll_s=0.1)\n"
           f"print(p.pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == -signal.SIGKILL, done.stderr
    server_pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server_pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")  # a zombie (exited, not yet reaped by init) counts as stopped
    return not (status.exists() and "State:\tZ" in status.read_text())
