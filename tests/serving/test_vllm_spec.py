"""vLLM launch specs: server grouping, LoRA modules, command lines and the errors raised before any launch.

vLLM itself is not installed in this environment; these tests check what overstory decides and builds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overstory.core.config import ConfigError, load_config
from overstory.models.registry import MINILM, SMOLLM2, resolve
from overstory.serving import vllm
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.launch import run_vllm_stack
from overstory.serving.ports import free_port
from overstory.serving.vllm import (
    ServerDied,
    VllmNotInstalled,
    VllmServer,
    plan_servers,
    server_env,
    start_server,
    vllm_command,
)

BASE = "Qwen/Qwen2.5-1.5B-Instruct"
ROOT = Path(__file__).resolve().parents[2]
TOOL_TEMPLATE = ROOT / "configs/serve/templates/smollm2_hermes_tools.jinja"


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
    # a restart on the same log keeps what the first start wrote (why it died), after a line naming each start
    again = [sys.executable, "-c", "import sys; print('second start'); sys.exit(4)"]
    with pytest.raises(ServerDied, match="exited with code 4"):
        start_server(again, "http://127.0.0.1:9", tmp_path / "vllm.log", timeout_s=30, poll_s=0.05)
    log = (tmp_path / "vllm.log").read_text()
    assert log.index("CUDA out of memory") < log.index("second start")
    assert sum(line.startswith("== ") for line in log.splitlines()) == 2


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


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_the_serve_configs_turn_on_hermes_tool_calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu = load_config(ServeConfig, ROOT / "configs/serve/cpu-vllm.yaml")
    monkeypatch.chdir(tmp_path)  # the template's relative path is found from anywhere, as an absolute path
    command = vllm_command(VllmServer(model=SMOLLM2, port=8001, served_names=["generator"]), "127.0.0.1",
                           cpu.vllm_args, python="/opt/vllm/bin/python")
    assert "--enable-auto-tool-choice" in command and _flag(command, "--tool-call-parser") == "hermes"
    assert "--exclude-tools-when-tool-choice-none" in command
    assert _flag(command, "--chat-template") == str(TOOL_TEMPLATE) and TOOL_TEMPLATE.is_file()
    # Qwen2.5's own template states tools in the same syntax: the H100 stack parses calls with no template of ours
    h100 = load_config(ServeConfig, ROOT / "configs/serve/h100-stack.yaml")
    command = vllm_command(VllmServer(model=BASE, port=8002, served_names=["scorer"]), "0.0.0.0", h100.vllm_args)
    assert _flag(command, "--tool-call-parser") == "hermes" and "--chat-template" not in command


def test_a_missing_chat_template_fails_before_launch() -> None:
    server = VllmServer(model=BASE, port=8001, served_names=["generator"])
    with pytest.raises(ConfigError, match="--chat-template configs/serve/templates/nope.jinja: no such file"):
        vllm_command(server, "127.0.0.1", ["--chat-template", "configs/serve/templates/nope.jinja"])
    literal = "{{ messages[0]['content'] }}"  # vLLM also takes the template itself
    assert vllm_command(server, "127.0.0.1", [f"--chat-template={literal}"])[-1] == f"--chat-template={literal}"


def test_the_tool_template_writes_the_embedded_engines_prompt() -> None:
    """vLLM with our template and the embedded engine show SmolLM2 the same prompt for the same request."""
    from transformers import AutoTokenizer

    from overstory.serving.tools import render_chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2))
    template = TOOL_TEMPLATE.read_text()
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    clock = {"type": "function", "function": {"name": "now"}}
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    ask = {"role": "user", "content": "Weather in Paris?"}
    cases = [
        ([ask], None),
        ([{"role": "system", "content": "Be brief."}, ask, {"role": "assistant", "content": "Sunny."},
          {"role": "user", "content": "Thanks"}], None),
        ([ask], [weather, clock]),
        ([{"role": "system", "content": "Be brief."}, ask], [weather]),
        ([ask, {"role": "assistant", "content": None, "tool_calls": calls},  # parallel calls, then their results
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
          {"role": "tool", "tool_call_id": "call_2", "content": "noon"}], [weather, clock]),
        ([ask, {"role": "assistant", "content": "Let me look.", "tool_calls": calls[:1]},
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "And?"}], None),
    ]
    for messages, tools in cases:
        expected = render_chat_prompt(tokenizer, messages, tools, "auto")
        # what vLLM hands the template: call arguments parsed, a tool's absent fields as null
        as_vllm = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                           "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        vllm_tools = [{**t, "function": {"name": None, "description": None, "parameters": None, **t["function"]}}
                      for t in tools] if tools else None
        rendered = tokenizer.apply_chat_template(as_vllm, tools=vllm_tools, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
        assert rendered == expected
        if tools:  # the tools reach the prompt, and the parser's syntax with them
            assert '{"name": "get_weather", "description": "Weather in a city", "parameters"' in rendered
            assert '<tool_call>{"name": <function name>, "arguments":' in rendered
    # the last case: a past call in the syntax vLLM's hermes parser reads, and its result as a user turn
    assert ('<|im_start|>assistant\nLet me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>') in rendered


def test_a_roles_own_vllm_args_go_to_its_server() -> None:
    @dataclasses.dataclass(frozen=True)
    class RoleWithArgs(RoleConfig):  # stands for RoleConfig.vllm_args until the config has the field
        vllm_args: list[str] = dataclasses.field(default_factory=list)

    config = ServeConfig(engine="vllm", port=8000, roles={
        "generator": RoleWithArgs(model=BASE, port=8001, vllm_args=["--enable-auto-tool-choice"]),
        "scorer": RoleWithArgs(model=BASE, port=8001),
        "planner": RoleWithArgs(model=BASE, port=8002, vllm_args=["--max-num-seqs", "8"])})
    shared, planner = plan_servers(config)[0]
    assert shared.extra_args == ["--enable-auto-tool-choice"] and planner.extra_args == ["--max-num-seqs", "8"]
    command = vllm_command(shared, "127.0.0.1", ["--enforce-eager"])
    assert command[-2:] == ["--enforce-eager", "--enable-auto-tool-choice"]  # the stack's flags, then the role's
    clash = dataclasses.replace(config, roles={**config.roles, "scorer": RoleWithArgs(model=BASE, port=8001,
                                                                                      vllm_args=["--seed", "1"])})
    with pytest.raises(ConfigError, match="roles.scorer and roles.generator share port 8001 but give different"):
        plan_servers(clash)


def test_the_key_reaches_vllm_in_its_environment_and_other_roles_stay_embedded() -> None:
    assert server_env({"VLLM_CPU_KVCACHE_SPACE": "1"}, "k") == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_API_KEY": "k"}
    assert server_env({}, None) == {"VLLM_API_KEY": ""}  # a VLLM_API_KEY of the caller's cannot lock the door out
    config = ServeConfig(engine="vllm", port=8000, api_key="k", roles={
        "generator": RoleConfig(model=BASE), "scorer": RoleConfig(model=MINILM, kind="cross-encoder"),
        "embedder": RoleConfig(model=MINILM, kind="embedding")})
    servers, rest = plan_servers(config)
    assert [s.roles for s in servers] == [["generator"]]
    # the embedded server keeps every other setting, the key included
    assert rest is not None and list(rest.roles) == ["scorer", "embedder"] and rest.api_key == "k"
    assert rest.engine == "embedded"
