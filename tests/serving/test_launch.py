"""`overstory serve` as users start it, a clear error when the port is taken, and the wiring of an
``engine: vllm`` stack (front door, stack.json, key) with stand-in processes in place of vLLM."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from overstory.core.config import ConfigError
from overstory.models.registry import MINILM
from overstory.serving import launch
from overstory.serving.client import Client, ClientError
from overstory.serving.config import RoleConfig, ServeConfig
from overstory.serving.engine import EmbeddedEngine
from overstory.serving.job_client import client_for
from overstory.serving.launch import run, serve_in_background, vllm_stack
from overstory.serving.ports import PortInUse, free_port

ROOT = Path(__file__).resolve().parents[2]


def test_port_in_use_fails_before_loading_models(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[ServeConfig] = []

    class NotLoaded(EmbeddedEngine):
        """Records that the models of a config were asked for, and loads none."""

        def __init__(self, config: ServeConfig) -> None:
            loaded.append(config)

    monkeypatch.setattr(launch, "EmbeddedEngine", NotLoaded)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}"):
            run(ServeConfig.local(port=port))
        with pytest.raises(PortInUse, match="stop the other server"), serve_in_background(ServeConfig.local(port=port)):
            pass
    assert loaded == []  # the port was checked before any model was loaded


def _worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("batcher-", "model-"))}


def test_a_stack_started_from_a_config_releases_its_models_on_exit() -> None:
    """The models' worker threads (a chat model's batcher, an encoder's model thread) end with the stack: alive,
    they held every model a job or a test session had ever served (the suite grew past 15 GiB resident)."""
    before = _worker_threads()
    with serve_in_background(ServeConfig.local(port=0)) as url:
        # a text no other test embeds: one already in the process's shared embedding cache never reaches MiniLM
        fresh_text = f"released on exit {uuid.uuid4()}"
        assert httpx.post(f"{url}/v1/embeddings", json={"model": "embedder", "input": [fresh_text]}).status_code == 200
        started = _worker_threads() - before
        assert {t.name.split("-")[0] for t in started} == {"batcher", "model"}  # SmolLM2's batcher, MiniLM's thread
    assert not any(t.is_alive() for t in started)


def test_a_jobs_client_sends_the_key_of_the_stack_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``client_for``'s client reaches a stack started with an API key (from the config, or from the environment as
    ``overstory serve`` reads it), where a client without the key is refused with a 401 (MiniLM alone: cheap)."""
    embedder_only = {"embedder": RoleConfig(model=MINILM, kind="embedding")}
    monkeypatch.setenv("OVERSTORY_API_KEY", "from-env")
    for serve, key in ((ServeConfig(port=0, api_key="job-key", roles=embedder_only), "job-key"),
                       (ServeConfig(port=0, roles=embedder_only), "from-env")):
        with client_for(serve) as client:
            assert client.embed("embedder", ["a"]).shape[0] == 1
            url = client.backend.urls
            with pytest.raises(ClientError) as refused:
                Client.from_url(url, max_retries=0).embed("embedder", ["a"])
            assert refused.value.status == 401
            assert httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200


def test_bad_serve_configs_name_the_key() -> None:
    with pytest.raises(ConfigError, match="roles.writer: unknown role"):
        ServeConfig(roles={"writer": RoleConfig(model="x")})
    with pytest.raises(ConfigError, match="roles.embedder.kind must be 'embedding'"):
        ServeConfig(roles={"embedder": RoleConfig(model="x")})


@pytest.mark.slow
def test_overstory_serve_command(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "overstory.cli", "serve", "--config", str(ROOT / "configs/serve/local.yaml"),
         f"port={port}", f"tracking.dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": "generator", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).json()
        assert reply["usage"]["completion_tokens"] > 0
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0]
    assert process.returncode == 0 and f"on http://127.0.0.1:{port}/v1" in output and "Traceback" not in output
    summary = json.loads(next(tmp_path.glob("serve-*/summary.json")).read_text())
    assert summary["roles"] == ["generator", "planner", "scorer", "embedder"] and summary["uptime_s"] > 0


# A stand-in for a vLLM OpenAI server (not vLLM): answers /health, lists its roles, and tells in each reply
# which port answered, the Authorization header it got and the VLLM_API_KEY it was started with.
STAND_IN = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, roles = int(sys.argv[1]), sys.argv[2].split(",")
class Handler(BaseHTTPRequestHandler):
    def reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self.reply({} if self.path == "/health" else {"object": "list", "data": [{"id": r} for r in roles]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.reply({"model": body["model"], "port": port, "authorization": self.headers.get("authorization"),
                    "vllm_api_key": os.environ.get("VLLM_API_KEY")})
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_a_vllm_stack_has_one_front_door(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launch, "require_vllm", lambda python="": sys.executable)
    monkeypatch.setattr(launch, "vllm_command", lambda server, host, extra_args=(), python="": [
        sys.executable, "-c", STAND_IN, str(server.port), ",".join(server.roles)])
    shared, own = free_port(), free_port()
    config = ServeConfig(engine="vllm", port=0, api_key="k", log_dir=str(tmp_path), roles={
        "generator": RoleConfig(model="a", port=shared), "planner": RoleConfig(model="a", port=shared),
        "scorer": RoleConfig(model="b", port=own)})
    with vllm_stack(config) as stack:
        # stack.json keeps role -> the server that runs it; the front door answers for all of them
        assert json.loads((tmp_path / "stack.json").read_text()) == stack.roles == {
            "generator": f"http://127.0.0.1:{shared}", "planner": f"http://127.0.0.1:{shared}",
            "scorer": f"http://127.0.0.1:{own}"}
        key = {"authorization": "Bearer k"}
        models = httpx.get(f"{stack.url}/v1/models", headers=key).json()
        assert [m["id"] for m in models["data"]] == ["generator", "planner", "scorer"]
        assert httpx.get(f"{stack.url}/health").status_code == 200
        for role, port in (("generator", shared), ("planner", shared), ("scorer", own)):
            reply = httpx.post(f"{stack.url}/v1/chat/completions", headers=key, json={"model": role, "messages": []})
            assert reply.json() == {"model": role, "port": port, "authorization": "Bearer k", "vllm_api_key": "k"}
        assert httpx.post(f"{stack.url}/v1/chat/completions", json={"model": "scorer"}).status_code == 401
        processes = [process for process, _ in stack.processes]
    assert len(processes) == 2 and all(process.poll() is not None for process in processes)


def test_a_vllm_stack_fails_on_a_taken_front_port_before_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "require_vllm", lambda python="": sys.executable)
    started: list = []
    monkeypatch.setattr(launch, "start_server", lambda *args, **kwargs: started.append(args))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = ServeConfig(engine="vllm", port=taken.getsockname()[1], roles={"generator": RoleConfig(model="a")})
        with pytest.raises(PortInUse), vllm_stack(config):
            pass
    assert started == []
